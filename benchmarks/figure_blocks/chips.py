"""Issue 62's figures (RESULTS "On the chips"): the v5e-8 config's every program at 16k tokens,
compiled by XLA:TPU with the page pool sized by `sampling.kv_cache_bytes: auto`."""

from __future__ import annotations

from figure_blocks import load

GIB = 2**30


def render_fit_16k() -> str:
    """Each program's peak per chip against 70% of a v5e's 16 GiB (results/memory_fit/qwen3_0.6b_v5e8_16k.json)."""
    got = load("memory_fit/qwen3_0.6b_v5e8_16k.json")
    hbm, kv = got["hbm_bytes"], got["workload"]["kv_cache"]
    lines = ["| program | temporaries | peak (GiB per chip) | share of the chip |", "|---|---:|---:|---:|"]
    for name, p in got["programs"].items():
        lines.append(f"| {name} | {p['temp_bytes'] / GIB:.2f} | {p['peak_bytes'] / GIB:.2f} | {p['peak_bytes'] / hbm:.0%} |")
    worst = max(p["peak_bytes"] for p in got["programs"].values()) / hbm
    lines += ["", f"The pool: `auto` -> {kv['pool'] / GIB:.2f} GiB per chip = {kv['fraction']} x ({kv['chip'] / GIB:.0f} "
                  f"GiB - {kv['held'] / GIB:.2f} held by the run - {kv['sampler'] / GIB:.2f} of the sampler's other "
                  f"buffers), {kv['slots']} slots ({kv['slots'] // got['devices']} per chip). Every program "
                  f"{'fits' if worst <= 0.7 else 'does not fit'} 70% of the chip (the largest: {worst:.0%}); "
                  f"verdict: {got['verdict_line']}."]
    return "\n".join(lines) + "\n"


BLOCKS = {"chips-fit-16k": render_fit_16k}
