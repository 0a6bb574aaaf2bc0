"""`grpo-jax bench engine`: the four engines run end to end on a tiny config and the JSON's
figures hold together (speed itself is measured in benchmarks/, never asserted here)."""

from __future__ import annotations

import json

from runs import CONFIG, write_config

from grpo_jax import cli


def test_bench_engine_writes_consistent_figures(tmp_path):
    # 2 prompts x G 2, 2 slots: the static engine in 2 batches of one prompt; a third of the char
    # vocabulary stops, so lengths vary.
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds"), "prompts_per_step": 2},
              "sampling": {**CONFIG["sampling"], "group_size": 2, "max_new_tokens": 6, "slots": 2, "page_size": 2,
                           "stop_token_ids": list(range(3, 36))}}
    out = tmp_path / "engine.json"
    assert cli.main(["bench", "engine", "--config", write_config(tmp_path, config), "--iters", "1",
                     "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["rows"] == 4 and result["workload"]["slots"] == 2
    for name in ("static_batched", "static_all", "continuous", "paged"):
        e = result["engines"][name]
        assert len(e["sequence_lengths"]) == 4 and all(1 <= n <= 6 for n in e["sequence_lengths"]), name
        assert e["useful_tokens"] == sum(e["sequence_lengths"]) > 0, name
        for key in ("wall_s", "useful_tokens_per_s", "prefill_s", "first_call_s"):
            assert e[key] > 0, (name, key)
        assert 0 < e["slot_utilisation"] <= 1 and e["kv_cache_bytes"]["total"] > 0, name
        assert e["slot_steps"] >= e["useful_tokens"], name
    continuous = result["engines"]["continuous"]
    # The engine's own count of busy slot-steps is the rollout's tokens; its prompts are prefilled once.
    assert continuous["engine_useful_slot_steps"] == continuous["useful_tokens"]
    assert continuous["prefill_rows"] == 2 and continuous["slot_steps"] == 2 * continuous["draw_steps"]
    # A static batch holds half the rows of the whole batch's cache.
    kv = {k: result["engines"][k]["kv_cache_bytes"]["generated"] for k in ("static_batched", "static_all")}
    assert 2 * kv["static_batched"] == kv["static_all"]
    assert (tmp_path / "engine.png").stat().st_size > 0 and result["ratios"]["continuous_vs_static_batched"] > 0
    # The paged engine: 3 x 2 slots, capped at the 4 sequences, over the continuous engine's bytes;
    # its sampled rollout is the continuous engine's (each sequence draws with its own uniforms).
    paged = result["engines"]["paged"]
    assert paged["sequence_lengths"] == continuous["sequence_lengths"]
    assert paged["paging"]["slots"] == 4 and paged["engine_useful_slot_steps"] == paged["useful_tokens"]
    assert paged["kv_cache_bytes"]["total"] <= result["engines"]["continuous"]["kv_cache_bytes"]["total"]
    assert 0 < paged["paging"]["pages_used_frac"] <= paged["paging"]["pages_peak_frac"] <= 1
    assert paged["concurrent_sequences"] >= continuous["concurrent_sequences"] > 0
    assert result["ratios"]["paged_vs_continuous"] > 0
