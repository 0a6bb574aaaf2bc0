"""The per-slot engine folded into the paged one (issue 61, item 7): the paged engine at the per-slot
engine's settings (`sampling.kv_cache_bytes: 0`, one max-length reservation per slot, read in place)
against `sampling.engine: continuous`, timed in one process, interleaved (`bench engine`'s rounds).

    python benchmarks/engine_fold.py CONFIG OUTPUT.json [key=value ...]

Until the fold, `continuous` ran the per-slot engine's own loop
(grpo_jax/engine/continuous.py); since, it names the paged engine with one reservation per slot,
so the ratio is the same program twice. The committed results ran before the fold: their
`source.commit` says which code they timed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.engine.engines import engine_of
from grpo_jax.runtime.sharding import one_device_mesh
from grpo_jax.tools.bench.engine import source_commit
from grpo_jax.tools.bench.engine_runs import length_stats, load_workload, median, time_interleaved


def runner(w, **settings):
    config = dataclasses.replace(w.sampling, **settings)
    ids, mask = jnp.asarray(w.ids), jnp.asarray(w.mask)

    def run():
        graphdef, state = nnx.split(w.model)  # as generate does on every call
        program = engine_of(config).program(graphdef, config, one_device_mesh())
        rollout, stats = jax.block_until_ready(program(state, ids, mask, w.key))
        return {"lengths": np.asarray(rollout.lengths), "truncated": np.asarray(rollout.truncated),
                "tokens": np.asarray(rollout.tokens), "stats": {k: int(v) for k, v in stats.items()}}

    return run


def main(config: str, output: str, *overrides: str, iters: int = 5) -> dict:
    w = load_workload(config, overrides)
    runners = {"continuous": runner(w, engine="continuous"), "paged_per_slot": runner(w, engine="paged",
                                                                                      kv_cache_bytes=0)}
    timing = time_interleaved(runners, iters, lambda line: print(line, file=sys.stderr, flush=True))
    out = {}
    for name, t in timing.items():
        r, wall = t["result"], median(t["times"])
        useful = int(r["lengths"].sum())
        out[name] = {"wall_s": round(wall, 4), "wall_s_all": [round(x, 4) for x in t["times"]],
                     "first_call_s": round(t["first_s"], 3), "useful_tokens": useful,
                     "useful_tokens_per_s": round(useful / wall, 1), "stats": r["stats"],
                     "lengths": length_stats(r["lengths"], r["truncated"], w.sampling.max_new_tokens)}
    c, p = timing["continuous"]["result"], timing["paged_per_slot"]["result"]
    result = {"benchmark": "engine_fold", "config": config, "overrides": list(overrides), "iters": iters,
              "workload": w.description, "engines": out,
              # Both draw each sequence from its own uniforms: the same rollout, token for token.
              "same_tokens": bool(np.array_equal(c["tokens"], p["tokens"])),
              "paged_per_slot_vs_continuous": round(out["paged_per_slot"]["useful_tokens_per_s"]
                                                    / out["continuous"]["useful_tokens_per_s"], 3),
              "paged_per_slot_vs_continuous_fastest": round(min(timing["continuous"]["times"])
                                                            / min(timing["paged_per_slot"]["times"]), 3),
              "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__, "source": source_commit()}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"paged per slot / continuous: {result['paged_per_slot_vs_continuous']} (fastest calls "
          f"{result['paged_per_slot_vs_continuous_fastest']}), same tokens {result['same_tokens']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
