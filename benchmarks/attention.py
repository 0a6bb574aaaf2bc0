"""Attention by length on this machine: plain XLA attention (today's, and round 3's) against the chunked
(flash-style) path, forward + backward of one causal layer's attention, the same inputs, in one run; what
`model.attention: auto` picks on CPU (`models.dispatch.AUTO_XLA_MAX_KEYS`) and issue 41's target
("chunked attention on CPU at 4k tokens: no slower than today's XLA attention at equal results").

    python benchmarks/attention.py --output benchmarks/results/attention/cpu.json

Each case: best of `--repeats` timed calls after one compile; the chunked path's result and
gradients are compared with XLA's (max abs difference) so the speed is at equal results.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.attention import attend

NEG = float(np.finfo(np.float32).min)


def round3_attention(q_BTHD, k_BSKD, v_BSKD, *, scale):
    """Round 3's XLA attention (models/layers.attention before issue 41), the baseline of "today's
    XLA attention": queries folded per kv head, a materialised causal [T, T] mask, one softmax."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    Q = H // K
    k_BKTD, v_BKTD = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
    mask_BTT = jnp.tril(jnp.ones((T, T), jnp.bool_))[None]
    q_BKWD = q_BTHD.reshape(B, T, K, Q, D).transpose(0, 2, 3, 1, 4).reshape(B, K, Q * T, D)
    s_BKWS = jnp.einsum("bkwd,bksd->bkws", q_BKWD, k_BKTD, preferred_element_type=jnp.float32) * scale
    s_BKQTS = jnp.where(mask_BTT[:, None, None], s_BKWS.reshape(B, K, Q, T, T), NEG)
    p_BKWS = jax.nn.softmax(s_BKQTS, axis=-1).reshape(B, K, Q * T, T).astype(v_BKTD.dtype)
    out_BKWD = jnp.einsum("bkws,bksd->bkwd", p_BKWS, v_BKTD)
    return out_BKWD.reshape(B, K, Q, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _case(impl: str, T: int, *, B: int, H: int, K: int, D: int, block: int, repeats: int):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32) for _ in range(2))
    seg = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    w = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)

    def loss(q, k, v):
        if impl == "round3":
            out = round3_attention(q, k, v, scale=D ** -0.5)
        else:
            out = attend(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                         scale=D ** -0.5, impl=impl, block_q=block, block_k=block)
        return jnp.sum(out * w), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    t0 = time.perf_counter()
    result = jax.block_until_ready(step(q, k, v))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    return min(times), compile_s, result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,128,256,512,1024,2048,4096")
    p.add_argument("--blocks", default="256,512")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    shape = dict(B=1, H=args.heads, K=args.kv_heads, D=args.head_dim)
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        xla_s, xla_compile, (( _, xla_out), xla_grads) = _case("xla", T, block=512, repeats=args.repeats, **shape)
        r3_s, r3_compile, ((_, r3_out), r3_grads) = _case("round3", T, block=512, repeats=args.repeats, **shape)
        row = {"tokens": T, "xla_s": xla_s, "xla_compile_s": xla_compile, "round3_xla_s": r3_s,
               "round3_xla_compile_s": r3_compile, "chunked": {}}
        for block in (int(x) for x in args.blocks.split(",")):
            s, c, ((_, out), grads) = _case("chunked", T, block=block, repeats=args.repeats, **shape)
            diff = max(float(jnp.abs(out - xla_out).max()),
                       *(float(jnp.abs(a - b).max()) for a, b in zip(grads, xla_grads)))
            diff3 = max(float(jnp.abs(out - r3_out).max()),
                        *(float(jnp.abs(a - b).max()) for a, b in zip(grads, r3_grads)))
            row["chunked"][str(block)] = {"s": s, "compile_s": c, "speedup_vs_xla": xla_s / s,
                                          "speedup_vs_round3_xla": r3_s / s, "max_abs_diff": diff,
                                          "max_abs_diff_vs_round3": diff3}
        best = min(row["chunked"], key=lambda b: row["chunked"][b]["s"])
        row["best_block"], row["best_speedup_vs_xla"] = int(best), row["chunked"][best]["speedup_vs_xla"]
        print(f"T={T:>5}: xla {xla_s:.3f} s, round 3's xla {r3_s:.3f} s, chunked (block {best}) "
              f"{row['chunked'][best]['s']:.3f} s -> {row['best_speedup_vs_xla']:.2f}x / "
              f"{row['chunked'][best]['speedup_vs_round3_xla']:.2f}x, max |diff| "
              f"{row['chunked'][best]['max_abs_diff']:.1e}", flush=True)
        rows.append(row)
    out = {"benchmark": "attention forward+backward, causal, one segment, float32", "shape": shape,
           "repeats": args.repeats, "rows": rows, "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "jax": jax.__version__}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
