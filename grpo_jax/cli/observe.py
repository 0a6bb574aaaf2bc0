"""The commands that look at things: `plot` and `report` (a run's metrics as a PNG and as an HTML
health report) and `smoke` (the model stack exercised on a tiny random model)."""

from __future__ import annotations

import argparse
import json
import sys

from grpo_jax.cli.common import UsageError, call, defaults, ints


def _smoke(args: argparse.Namespace) -> int:
    from grpo_jax.tools import smoke

    summary = call(smoke.smoke, args)
    print(json.dumps(summary))
    err = summary["cache_vs_full_max_abs_diff"]
    if err > smoke.MAX_ABS_DIFF:
        print(f"FAILED: KV-cache decode differs from the full pass by {err:.3g}", file=sys.stderr)
        return 1
    return 0


def _plot(args: argparse.Namespace) -> int:
    from grpo_jax.observe.plots import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _report(args: argparse.Namespace) -> int:
    from grpo_jax.observe.report import screenshot, write_report

    try:
        path, flags = write_report(args.run_dir, args.out)
        shot = screenshot(path, args.screenshot) if args.screenshot else None
    except (ValueError, RuntimeError) as e:  # unreadable metrics, no chromium for the screenshot
        raise UsageError(str(e)) from e
    for f in flags:
        print(f"{'flag' if f.level == 'failure' else 'notice'}: {f.title}: {f.evidence}", file=sys.stderr)
    print(json.dumps({"report": str(path), "flags": [f.key for f in flags if f.level == "failure"],
                      "notices": [f.key for f in flags if f.level != "failure"],
                      **({"screenshot": str(shot)} if shot else {})}))
    return 0


def add_commands(sub) -> None:
    """The parsers of `plot`, `report` and `smoke`."""
    from grpo_jax.tools import smoke as smoke_tool

    plot = sub.add_parser("plot", help="PNG of reward, eval accuracy, KL, entropy, completion length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot, prog=plot.prog)

    report = sub.add_parser("report", help="one HTML page flagging a run's failure patterns (entropy collapse, dead "
                                           "groups, reward hacking, length blow-up, KL and sampler drift)")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="HTML path (default RUN_DIR/report.html)")
    report.add_argument("--screenshot", default=None, metavar="PNG",
                        help="also render the page in headless Chromium to this PNG (needs chromium on PATH)")
    report.set_defaults(func=_report, prog=report.prog)

    smoke = sub.add_parser("smoke", help="build a tiny random model, save/load it in HF format, sample with the KV cache")
    d = defaults(smoke_tool.smoke)
    smoke.add_argument("--family", default=d["family"],
                       choices=["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text"])
    smoke.add_argument("--output", default=d["output"], help="where the HF-format model is written (default %(default)s)")
    smoke.add_argument("--new-tokens", type=ints(smoke_tool.MIN_NEW_TOKENS), default=d["new_tokens"],
                       help=f"at least {smoke_tool.MIN_NEW_TOKENS} (default %(default)s)")
    smoke.add_argument("--seed", type=int, default=d["seed"])
    smoke.set_defaults(func=_smoke, prog=smoke.prog)
