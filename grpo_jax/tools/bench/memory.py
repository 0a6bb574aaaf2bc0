"""`grpo-jax bench memory`: the device memory a run's programs need, per device, before it launches.

A run's programs (the sampler, the evaluation sampler, the reference log-probs when grpo.beta > 0,
the train step) are built by the code a run builds them with (`learner.parallel.make_parallel`,
`engine.sampling.static_program`) on abstract shapes (`nnx.eval_shape`, `jax.eval_shape`: no
parameter is ever materialised), lowered with the run's shardings over N forced host devices, and
compiled; each compiled program's `memory_analysis()` gives its arguments, outputs, temporaries
and generated code per device. What the run holds outside a program while it runs (the optimizer
state while sampling, the KL reference's copy, the batch) is added from the abstract shapes and
their shardings, and the largest total is set against a chip's HBM.

The figures are XLA:CPU's buffer assignment for the same shapes and shardings, not XLA:TPU's: TPU
fuses and lays out differently and its runtime keeps some HBM for itself, so keep a margin (the
pod configs keep about 50%, and say to keep 30% or more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import grpo_jax

GIB = 1 << 30
# HBM per chip (Cloud TPU's system architecture pages): the budget a run's programs are set against.
CHIPS = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def memory(config_path: str, *, overrides: Sequence[str] = (), devices: int = 8, chip: str = "v5e",
           preset: str = "", log: Callable[[str], None] = _to_stderr) -> dict:
    """Compile a run config's programs on abstract shapes over `devices` host devices and return
    each one's memory per device against `chip`'s HBM, with a verdict and the margin.

    The model's shape comes from `preset` (a name of `bench.PRESETS`, for a model whose files are
    not on this machine), else from the config (model.architecture, or model.path's config.json).
    JAX must start with `devices` host devices: in a process where it has not started yet this
    sets XLA_FLAGS; where it runs with another count, the measurement runs in a child process.
    `log`: a line per program and the verdict, as they come (stderr: stdout is the CLI's JSON)."""
    from grpo_jax.config import ConfigError, load_config

    if chip not in CHIPS:
        raise ConfigError(f"bench memory: unknown chip {chip!r}; choose one of {list(CHIPS)}")
    if devices < 1:
        raise ConfigError(f"bench memory needs --devices >= 1, got {devices}")
    config = load_config(config_path, overrides)  # without JAX: a config's mistakes are reported here
    if not _host_devices_ready(devices):
        return _in_child(config_path, overrides=overrides, devices=devices, chip=chip, preset=preset)
    result = measure(config, chip=chip, preset=preset, log=log)
    return {"system": "grpo_jax", "version": grpo_jax.__version__, "config": str(config_path),
            "overrides": list(overrides), **result}


def _host_devices_ready(devices: int) -> bool:
    """Whether this process runs JAX on `devices` CPU devices, starting it so if JAX is not imported."""
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), devices)
        os.environ["JAX_PLATFORMS"] = "cpu"  # abstract shapes on host devices, whatever this machine has
    import jax

    return jax.default_backend() == "cpu" and jax.device_count() == devices


def with_device_count(flags: str, devices: int) -> str:
    """XLA_FLAGS with the forced host device count set to `devices` (other flags kept)."""
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={devices}"])


def _in_child(config_path: str, *, overrides: Sequence[str], devices: int, chip: str, preset: str) -> dict:
    """`grpo-jax bench memory` in a fresh process (JAX cannot change its device count once started)."""
    from grpo_jax.config import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        cmd = [sys.executable, "-m", "grpo_jax", "bench", "memory", "--config", str(config_path),
               "--devices", str(devices), "--chip", chip, "--output", out,
               *([f"--preset={preset}"] if preset else []), *(f"--set={o}" for o in overrides)]
        # Its table and any error go to this process's stderr; its JSON comes back in the file.
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise ConfigError(f"bench memory on {devices} devices failed in its own process (exit status "
                              f"{done.returncode}; its message is above)")
        with open(out) as f:
            return json.load(f)


def measure(config, *, chip: str, preset: str = "", log: Callable[[str], None] = lambda line: None) -> dict:
    """`memory` in this process, on its devices: the JSON fields after the config's name."""
    import jax

    from grpo_jax.config import ConfigError
    from grpo_jax.runtime.devices import check_devices, run_mesh
    from grpo_jax.tools.bench.abstract_run import abstract_run

    if config.parallelism != "jit":
        raise ConfigError("bench memory measures parallelism: jit (the pmap mode replicates the state on every "
                          "device, so a pod runs jit)")
    check_devices(config)
    mesh = run_mesh(config)
    run = abstract_run(config, mesh, preset=preset)
    log(f"{'program':<14}{'arguments':>11}{'outputs':>10}{'temps':>10}{'code':>8}{'held':>10}{'peak':>10}  "
        f"GiB per device ({len(mesh.devices.flat)} devices, {chip})")
    programs = {}
    for name, (lowered, in_args) in run.programs.items():
        t0 = time.perf_counter()
        analysis = lowered.compile().memory_analysis()
        held = sum(v for part, v in run.resident.items() if part not in in_args)
        programs[name] = figures(analysis, held=held, compile_s=time.perf_counter() - t0)
        log(_line(name, programs[name]))
    peak_program = max(programs, key=lambda p: programs[p]["peak_bytes"])
    peak, hbm = programs[peak_program]["peak_bytes"], CHIPS[chip]
    verdict = "fits" if peak <= hbm else "does not fit"
    log(f"{verdict} on {chip} ({hbm / GIB:.0f} GiB): peak {peak / GIB:.2f} GiB ({peak_program}), margin "
        f"{(hbm - peak) / GIB:.2f} GiB ({(hbm - peak) / hbm:.0%})")
    return {"devices": len(mesh.devices.flat), "mesh": dict(mesh.shape), "chip": chip, "hbm_bytes": hbm,
            "model": run.model, "workload": run.workload, "resident_bytes": run.resident, "programs": programs,
            "not_compiled": run.not_compiled, "peak_program": peak_program, "peak_bytes": peak,
            "margin_bytes": hbm - peak, "margin_frac": (hbm - peak) / hbm, "verdict": verdict,
            "backend": jax.default_backend(),
            "note": "per device; XLA:CPU's buffer assignment for the run's shapes and shardings, not XLA:TPU's"}


def figures(analysis, *, held: int, compile_s: float) -> dict:
    """One compiled program's bytes per device from its `memory_analysis()`, with `held` (what the
    run keeps outside its arguments meanwhile) and `peak_bytes`: held + arguments + outputs not
    aliased to a donated argument + temporaries + generated code."""
    a = analysis
    out = {"argument_bytes": a.argument_size_in_bytes, "output_bytes": a.output_size_in_bytes,
           "alias_bytes": a.alias_size_in_bytes, "temp_bytes": a.temp_size_in_bytes,
           "generated_code_bytes": a.generated_code_size_in_bytes, "held_bytes": int(held)}
    out["peak_bytes"] = (out["held_bytes"] + out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"] + out["generated_code_bytes"])
    out["compile_s"] = round(compile_s, 2)
    return out


def _line(name: str, f: dict) -> str:
    gib = [f[k] / GIB for k in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes",
                                "held_bytes", "peak_bytes")]
    return f"{name:<14}{gib[0]:>11.3f}{gib[1]:>10.3f}{gib[2]:>10.3f}{gib[3]:>8.3f}{gib[4]:>10.3f}{gib[5]:>10.3f}"
