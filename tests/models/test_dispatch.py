"""Attention dispatch (grpo_jax.models.dispatch): the table of which implementation `auto` picks on
each platform (faked where there is no device) for each pass and model feature; explicit choices
that cannot run a pass refused in one line naming one that can (by the dispatcher, by `grpo-jax
check`); every kernel a platform's `auto` can pick run on its pass in interpret mode on CPU against
the XLA reference (the GPU paged decode kernel against the gather path); and a GPU-shaped run on
CPU (platform faked, kernels interpreted) training with shared prompts, packing and the paged
engine, equal to the same run on CPU's own choices."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import CONFIG

from grpo_jax.config import ConfigError, MeshConfig, config_from_dict
from grpo_jax.engine import paged_decode
from grpo_jax.engine.paged_decode import gather_attention, gpu_kernel_attention
from grpo_jax.models import dispatch, kernels
from grpo_jax.models.attention import attend
from grpo_jax.models.dispatch import DECODE, MODEL, Need, model_need, pick
from grpo_jax.models.layers import attention_impl, parents_supported
from grpo_jax.models.presets import tiny
from grpo_jax.runtime.platform import faked_platform, platform_of
from grpo_jax.runtime.sharding import make_mesh, one_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (platform, pass, features) -> what `auto` picks. Features: window, softcap, no mesh, keys, head_dim.
TABLE = [
    ("cpu", "plain", {"keys": 128}, "xla"),
    ("cpu", "plain", {"keys": 512}, "chunked"),
    ("cpu", "shared_prompt", {"keys": 512}, "chunked"),
    ("cpu", "packed", {"keys": 64}, "xla"),
    ("cpu", "plain", {"keys": 512, "window": True, "softcap": True}, "chunked"),
    ("cpu", "decode", {}, "gather"),
    ("gpu", "plain", {}, "gpu"),
    ("gpu", "plain", {"keys": 64}, "gpu"),
    ("gpu", "shared_prompt", {}, "chunked"),  # the Triton kernel takes one segment array: no keys before queries
    ("gpu", "packed", {}, "chunked"),
    ("gpu", "plain", {"window": True}, "chunked"),
    ("gpu", "plain", {"softcap": True}, "chunked"),
    ("gpu", "plain", {"mesh": False}, "chunked"),
    ("gpu", "decode", {}, "gather"),  # the GPU paged kernel is asked for by name until it has run on a GPU
    ("gpu", "decode", {"softcap": True}, "gather"),
    ("gpu", "decode", {"window": True}, "gather"),
    ("gpu", "decode", {"head_dim": 24}, "gather"),
    ("gpu", "decode", {"page_size": 8}, "gather"),
    ("tpu", "plain", {}, "splash"),
    ("tpu", "shared_prompt", {"window": True, "softcap": True}, "splash"),
    ("tpu", "packed", {}, "chunked"),  # splash compares segment ids by equality: no parents
    ("tpu", "plain", {"mesh": False}, "chunked"),
    ("tpu", "decode", {"head_dim": 128}, "pallas"),
    ("tpu", "decode", {"head_dim": 128, "window": True, "softcap": True}, "pallas"),
    ("tpu", "decode", {"head_dim": 64}, "gather"),
    ("tpu", "decode", {"head_dim": 128, "page_size": 4}, "gather"),
]


@pytest.mark.parametrize("platform,name,features,want", TABLE,
                         ids=[f"{p}-{n}-{'-'.join(f'{k}={v}' for k, v in f.items())}" for p, n, f, _ in TABLE])
def test_auto_picks_the_fastest_implementation_that_supports_the_pass(platform, name, features, want):
    need = Need(name=name, platform=platform, **{"keys": 4096, "head_dim": 64, "kv_heads": 2, "heads": 4, **features})
    assert pick("auto", need) == want
    table = DECODE if name == "decode" else MODEL
    assert table[want].refuses(need) is None
    # Nothing faster in the platform's order could have run it.
    order = dispatch.auto_order(need)
    assert all(table[n].refuses(need) for n in order[:order.index(want)])


def test_an_explicit_choice_that_cannot_run_a_pass_is_refused_naming_one_that_can():
    gpu = Need(name="shared_prompt", platform="gpu", keys=512, head_dim=64)
    with pytest.raises(ValueError, match=r"^model.attention=gpu cannot run the shared-prompt pass \(keys before the "
                                         r"queries\).*; use model.attention=chunked \(or auto\)$"):
        pick("gpu", gpu)
    with pytest.raises(ValueError, match=r"model.attention=splash runs on tpu, and this run's devices are cpu.*"
                                         r"use model.attention=xla"):
        pick("splash", Need(name="plain", platform="cpu", keys=64))
    with pytest.raises(ValueError, match=r"sampling.paged_attention=gpu has no sliding window.*use "
                                         r"sampling.paged_attention=gather"):
        pick("gpu", Need(name="decode", platform="gpu", window=True))
    with pytest.raises(ValueError, match="needs head_dim % 128 == 0"):
        pick("pallas", Need(name="decode", platform="tpu", head_dim=64))
    # Choices that can run are returned as given (chunked is slower than splash on TPU, and allowed).
    assert pick("chunked", Need(name="plain", platform="tpu")) == "chunked"
    assert pick("gpu", Need(name="plain", platform="gpu")) == "gpu"
    assert pick("gpu", Need(name="decode", platform="gpu")) == "gpu"
    assert pick("gpu", Need(name="decode", platform="gpu", softcap=True)) == "gpu"


def test_the_model_passes_ask_by_platform_and_model_features():
    """attention_impl and parents_supported read the (faked) platform and the model's features."""
    qwen, gemma = tiny("qwen3"), tiny("gemma3_text")
    mesh = one_device_mesh()
    assert platform_of(mesh) == "cpu" and attention_impl("auto", qwen, keys=64, mesh=mesh) == "xla"
    with faked_platform("gpu"):
        assert platform_of(mesh) == "gpu"
        assert attention_impl("auto", qwen, keys=64, mesh=mesh) == "gpu"
        assert attention_impl("auto", qwen, keys=64, mesh=mesh, pass_name="shared_prompt") == "chunked"
        assert attention_impl("auto", gemma, keys=64, mesh=mesh) == "chunked"  # sliding layers
        assert attention_impl("auto", qwen, keys=64, mesh=None) == "chunked"
        assert not parents_supported("auto", qwen, mesh) and parents_supported("auto", gemma, mesh)
        assert paged_decode.choose_attention("auto", qwen, jnp.float32, 16, mesh) == "gather"
        assert paged_decode.choose_attention("gpu", qwen, jnp.float32, 16, mesh) == "gpu"
        assert paged_decode.choose_attention("auto", gemma, jnp.float32, 16, mesh) == "gather"
    with faked_platform("tpu"):
        assert attention_impl("auto", gemma, keys=64, mesh=mesh, pass_name="shared_prompt") == "splash"
        assert paged_decode.choose_attention("auto", tiny("qwen3", head_dim=128), jnp.bfloat16, 16, mesh) == "pallas"
    assert model_need("plain", gemma, "cpu").window and not model_need("plain", qwen, "cpu").window


def _pass_inputs(name: str, rng):
    """q [B, T, H, D], k, v [B, S, K, D] and the ids of pass `name`: "plain" two left-padded rows,
    "shared_prompt" completions over a prompt prefix (S > T)."""
    B, H, K, D = 2, 4, 2, 16
    T, S = (24, 24) if name == "plain" else (16, 40)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, D), (B, S, K, D), (B, S, K, D)))
    kv_seg = np.ones((B, S), np.int32)
    kv_seg[1, :5] = 0  # left padding
    kv_pos = np.maximum(np.cumsum(kv_seg, axis=1) - 1, 0).astype(np.int32)
    ids = dict(q_segment_ids=jnp.asarray(kv_seg[:, S - T:]), kv_segment_ids=jnp.asarray(kv_seg),
               q_positions=jnp.asarray(kv_pos[:, S - T:]), kv_positions=jnp.asarray(kv_pos))
    return q, k, v, ids


KERNEL_PASSES = [(impl.name, p) for impl in MODEL.values() if impl.kernel for p in sorted(impl.passes)]


@pytest.mark.parametrize("impl,name", KERNEL_PASSES, ids=[f"{i}-{p}" for i, p in KERNEL_PASSES])
def test_every_kernel_runs_each_pass_it_declares_and_equals_the_xla_reference(impl, name):
    """The declared table is what the kernels do: each (kernel, pass) it lists runs interpreted on
    CPU and equals `xla` on the pass's rows, with the features it declares (window, soft cap)."""
    q, k, v, ids = _pass_inputs(name, np.random.default_rng(len(name)))
    extra = {"window": 7 if MODEL[impl].window else None, "softcap": 2.0 if MODEL[impl].softcap else None}
    want = attend(q, k, v, **ids, **extra, scale=0.25, impl="xla")
    got = attend(q, k, v, **ids, **extra, scale=0.25, impl=impl, interpret=True)
    real = np.asarray(ids["q_segment_ids"]) != 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


def test_a_pass_a_kernel_does_not_declare_is_refused_by_the_kernel_too():
    """Where the table says no, the wrapper raises rather than computing a wrong mask."""
    q, k, v, ids = _pass_inputs("shared_prompt", np.random.default_rng(0))
    assert "shared_prompt" not in MODEL["gpu"].passes
    with pytest.raises(ValueError, match="keys before the queries"):
        kernels.gpu_attention(q, k, v, **ids, scale=0.25, interpret=True)


def test_the_gpu_paged_kernel_in_interpret_mode_equals_the_gather_path():
    """`gpu_kernel_attention` (JAX's Pallas GPU paged kernel body under shard_map over 2 row shards)
    interpreted on CPU equals `gather_attention` on the same pages: ragged lengths (1 token to past
    one partition), GQA 2:1, page tables in random order, with and without a soft cap; an empty slot
    gives 0."""
    rng = np.random.default_rng(1)
    Z, J, H, K, D, Sg, T, pages = 2, 3, 4, 2, 16, 16, 5, 16
    lengths = np.array([[1, 17, 80], [0, 16, 33]], np.int32)
    table = np.stack([rng.permutation(np.arange(1, pages))[:J * T].reshape(J, T) for _ in range(Z)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(Z * J, H, D)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(Z, pages, K, Sg, D)), jnp.float32) for _ in range(2))  # "heads"
    split = (keys.transpose(0, 1, 2, 4, 3), values)  # the same pages in the gather path's layout
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    real = lengths.reshape(-1) > 0
    for cap in (None, 3.0):
        want = gather_attention(q, split, jnp.asarray(table), jnp.asarray(lengths), window=None, scale=D ** -0.5,
                                cap=cap, dtype=jnp.float32)
        got = gpu_kernel_attention(q, (keys, values), jnp.asarray(table), jnp.asarray(lengths), window=None,
                                   scale=D ** -0.5, cap=cap, mesh=mesh, interpret=True)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6, err_msg=f"{cap=}")
        assert not np.asarray(got)[~real].any()
        shuffled = gather_attention(q, split, jnp.asarray(table[..., ::-1]), jnp.asarray(lengths), window=None,
                                    scale=D ** -0.5, cap=cap, dtype=jnp.float32)
        assert np.abs(np.asarray(shuffled) - np.asarray(got))[real].max() > 0.1  # the table's order is read


def test_check_refuses_an_explicit_choice_that_cannot_run_a_pass(tmp_path):
    from grpo_jax.trainer.check import check

    demo = os.path.join(ROOT, "configs", "demo_cpu.yaml")
    base = [f"data.data_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"^model.attention=gpu runs on gpu, and this run's devices are cpu, "
                                          r"which this run needs for the plain pass; use model.attention=\w+"):
        check(config=demo, overrides=[*base, "model.attention=gpu"], log=lambda line: None)
    with faked_platform("gpu"):
        with pytest.raises(ConfigError, match="model.attention=gpu cannot run the shared-prompt pass.*chunked"):
            check(config=demo, overrides=[*base, "model.attention=gpu"], log=lambda line: None)
        lines = check(config=demo, overrides=[*base, "model.attention=gpu", "train.shared_prompt=false"],
                      log=lambda line: None)
    assert any(line.startswith("check: attention (gpu): plain: gpu") for line in lines), lines


def _gpu_shaped(tmp_path, packing: bool, platform: str):
    arch = CONFIG["model"]["architecture"]
    return config_from_dict({
        **CONFIG, "model": {**CONFIG["model"], "architecture": {**arch, "num_layers": 1}},
        "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds"), "prompts_per_step": 4},
        "sft": {"steps": 0}, "eval": {"every": 0}, "checkpoint": {},
        # A page pool of 16-token pages (the GPU kernel's smallest), sequences beyond one page.
        "sampling": {**CONFIG["sampling"], "group_size": 4, "max_new_tokens": 12, "engine": "paged", "slots": 8,
                     "page_size": 16, "kv_cache_bytes": 64 * 16 * 2 * 2 * 16 * 4,
                     **({"paged_attention": "gpu"} if platform == "gpu" else {})},
        "train": {**CONFIG["train"], "steps": 1, "samples_every": 0, "packing": packing}})


def test_a_gpu_shaped_run_trains_on_cpu_with_the_kernels_interpreted(tmp_path, monkeypatch):
    """Platform faked as GPU, one step with shared prompts and one packed: the prefill and the packed
    training pass run the Triton flash kernel, the shared-prompt pass the chunked path, decoding the
    GPU paged kernel, all interpreted. Each step's metrics equal the unpacked run's with CPU's own
    choices (xla, gather), which traces no GPU kernel."""
    from grpo_jax.trainer.loop import train

    calls = dict.fromkeys(("gpu_attention", "gpu_kernel_attention", "gather_attention"), 0)

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(kernels, "gpu_attention")
    counted(paged_decode, "gpu_kernel_attention")
    counted(paged_decode, "gather_attention")
    runs = {}
    for platform, packing in (("gpu", False), ("gpu", True), ("cpu", False)):
        seen, before = [], dict(calls)
        with faked_platform(platform):
            train(_gpu_shaped(tmp_path, packing, platform), tmp_path / f"{platform}-{packing}",
                  hooks=[lambda step, m: seen.append(m)], log=lambda s: None)
        runs[platform, packing] = seen[0]
        traced = {k: calls[k] - before[k] for k in calls}
        if platform == "gpu":
            assert traced["gpu_attention"] > 0 and traced["gpu_kernel_attention"] > 0, traced
            assert traced["gather_attention"] == 0, traced
        else:
            assert traced["gather_attention"] > 0 and traced["gpu_attention"] == traced["gpu_kernel_attention"] == 0
    cpu = runs["cpu", False]
    assert np.isfinite(cpu["train/loss"]) and cpu["completion/len_mean"] > 0
    for packing in (False, True):
        gpu = runs["gpu", packing]
        for key in ("completion/len_mean", "reward/mean", "train/loss", "train/grad_norm"):
            assert gpu[key] == pytest.approx(cpu[key], rel=1e-4, abs=1e-6), (packing, key)
