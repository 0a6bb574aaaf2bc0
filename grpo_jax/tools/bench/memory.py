"""`grpo-jax bench memory`: the device memory a run's programs need, per device, before it launches.

A run's programs (the sampler, the evaluation sampler, the reference log-probs when grpo.beta > 0,
the train step) are built by the code a run builds them with (`learner.modes.make_learner`,
`engine.engines.Engine.program`) on abstract shapes (`nnx.eval_shape`, `jax.eval_shape`: no
parameter is ever materialised), lowered with the run's shardings and compiled; each compiled
program's `memory_analysis()` gives its arguments, outputs, temporaries and generated code per
device, and its `cost_analysis()` its FLOPs and bytes accessed per device (XLA counts a loop's
body once: the layer scan, the micro-batch scan and the decode loop run it many times, so these
are a floor, not the step's; `bench grpo-step` counts a step's model FLOPs). What the run holds
outside a program while it runs (the optimizer state while sampling, the KL reference's copy, the
batch) is added from the abstract shapes and their shardings, and the largest total is set against
a chip's HBM.

Two compilers:
- by default, XLA:CPU over N forced host devices: its buffer assignment for the run's shapes and
  shardings, not XLA:TPU's (TPU fuses and lays out differently and its runtime keeps some HBM for
  itself), so keep a margin (the pod configs keep about 50%, and say to keep 30% or more);
- with `topology` (e.g. "v5e:2x4"), XLA:TPU itself, from libtpu (the `tpu-compile` extra), on the
  compile-only devices of `jax.experimental.topologies.get_topology_desc`: no TPU is needed, and
  the figures are the chip's own. XLA:TPU refuses a program that cannot fit in HBM; that refusal
  is reported as the program's figures (what it needs, what HBM has) and the verdict.

The TPU plugin is loaded but never started as a backend (the process runs on JAX_PLATFORMS=cpu);
libtpu's lock on /tmp/libtpu_lockfile, which lets one process at a time own a machine's TPUs, is
waived (ALLOW_MULTIPLE_LIBTPU_LOAD) since nothing here runs on a chip, so several such compiles
(parallel tests, other users) can share a machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import grpo_jax
from grpo_jax.tools.bench.programs import NOT_ASKED, PROGRAMS

GIB = 1 << 30
# HBM per chip (Cloud TPU's system architecture pages): the budget a run's programs are set against.
CHIPS = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_CHILD = "GRPO_JAX_BENCH_MEMORY_DEVICES"  # set in the process `_in_child` starts: it must not start another
_HOST_DEVICES = 8  # without a topology
TOPOLOGY_EXAMPLES = "v5e:2x2, v5e:2x4, v5e:4x4, v5e:4x8, v6e:2x2, v6e:2x4, v5p:2x2x1, v5p:2x2x2"
INSTALL_TPU_COMPILER = "pip install 'grpo-jax[tpu-compile]' (jax[tpu]==0.10.2 with its libtpu, ~700 MB)"


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def memory(config_path: str, *, overrides: Sequence[str] = (), devices: int = 0, chip: str = "",
           topology: str = "", preset: str = "", programs: Sequence[str] = (),
           log: Callable[[str], None] = to_stderr) -> dict:
    """Compile a run config's programs on abstract shapes and return each one's memory per device
    against a chip's HBM, with a verdict and the margin.

    Without `topology`: XLA:CPU over `devices` host devices (default 8), against `chip`'s HBM
    (default v5e). With `topology` (a libtpu topology name, e.g. "v5e:2x4"): XLA:TPU over that
    slice's chips, the chip taken from the name; the config's mesh must use every chip.
    The model's shape comes from `preset` (a name of `bench.PRESETS`, for a model whose files are
    not on this machine), else from the config (model.architecture, or model.path's config.json).
    `programs`: only these of `PROGRAMS` are compiled (default: all the run has); the others are in
    `not_compiled` as `NOT_ASKED`, and the verdict is of those compiled.
    JAX must run on as many host devices as the programs have devices (they stand in for them in
    the config's checks): in a process where JAX has not started yet this sets XLA_FLAGS; where it
    runs with another count, the measurement runs in a child process.
    `log`: a line per program and the verdict, as they come (stderr: stdout is the CLI's JSON)."""
    from grpo_jax.config import ConfigError, load_config

    if topology:
        if devices:
            raise ConfigError(f"bench memory: --devices and --topology both give the device count; --topology "
                              f"{topology} has its own, leave --devices out")
        chip = topology_chip(topology, chip)
    chip = chip or "v5e"
    if chip not in CHIPS:
        raise ConfigError(f"bench memory: unknown chip {chip!r}; choose one of {list(CHIPS)}")
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ConfigError(f"bench memory --programs: unknown {', '.join(unknown)}; name some of {', '.join(PROGRAMS)}")
    devices = devices or _HOST_DEVICES
    if devices < 1:
        raise ConfigError(f"bench memory needs --devices >= 1, got {devices}")
    config = load_config(config_path, overrides)  # without JAX: a config's mistakes are reported here
    fresh = "jax" not in sys.modules
    if fresh:
        os.environ["JAX_PLATFORMS"] = "cpu"  # abstract shapes on host devices, whatever this machine has
    chips = None
    if topology:
        chips = topology_devices(topology)
        devices = len(chips)
    if not host_devices_ready(devices, fresh):
        if os.environ.get(_CHILD) == str(devices):  # its own process could not set the count either: never again
            raise ConfigError(f"bench memory: JAX was already started in its own process, so it could not run on "
                              f"{devices} devices (something imported JAX before `bench memory` began)")
        return _in_child(config_path, overrides=overrides, devices=devices, chip=chip, topology=topology,
                         preset=preset, programs=programs)
    result = measure(config, chip=chip, preset=preset, log=log, topology=topology, chips=chips, programs=programs)
    return {"system": "grpo_jax", "version": grpo_jax.__version__, "config": str(config_path),
            "overrides": list(overrides), **result}


def host_devices_ready(devices: int, fresh: bool) -> bool:
    """Whether this process runs JAX on `devices` CPU devices, starting it so if it is `fresh` (JAX
    was not imported when `memory` was called: its CPU backend reads XLA_FLAGS when it starts)."""
    if fresh:
        os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), devices)
    import jax

    return jax.default_backend() == "cpu" and jax.device_count() == devices


def with_device_count(flags: str, devices: int) -> str:
    """XLA_FLAGS with the forced host device count set to `devices` (other flags kept)."""
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={devices}"])


def _in_child(config_path: str, *, overrides: Sequence[str], devices: int, chip: str, topology: str,
              preset: str, programs: Sequence[str]) -> dict:
    """`grpo-jax bench memory` in a fresh process (JAX cannot change its device count once started)."""
    from grpo_jax.config import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        device_args = ["--topology", topology] if topology else ["--devices", str(devices)]
        cmd = [sys.executable, "-m", "grpo_jax", "bench", "memory", "--config", str(config_path),
               *device_args, "--chip", chip, "--output", out,
               *([f"--preset={preset}"] if preset else []), *([f"--programs={','.join(programs)}"] if programs else []),
               *(f"--set={o}" for o in overrides)]
        # Its table and any error go to this process's stderr; its JSON comes back in the file.
        done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, env={**os.environ, _CHILD: str(devices)})
        if done.returncode:
            where = f"--topology {topology}" if topology else f"{devices} devices"
            raise ConfigError(f"bench memory on {where} failed in its own process (exit status {done.returncode}; "
                              "its message is above)")
        with open(out) as f:
            return json.load(f)


def measure(config, *, chip: str, preset: str = "", log: Callable[[str], None] = lambda line: None,
            topology: str = "", chips: Sequence | None = None, programs: Sequence[str] = ()) -> dict:
    """`memory` in this process: the JSON fields after the config's name. The programs (`programs`
    of them, or all) are compiled for this process's devices, or with `topology` for `chips` (its
    compile-only TPU devices, as many as this process has host devices: those stand in for them in
    the config's checks)."""
    import jax

    from grpo_jax.config import ConfigError
    from grpo_jax.runtime.devices import check_devices, run_mesh
    from grpo_jax.tools.bench.abstract_run import abstract_run

    if config.parallelism != "jit":
        raise ConfigError("bench memory measures parallelism: jit (the pmap mode replicates the state on every "
                          "device, so a pod runs jit)")
    check_devices(config)
    mesh = run_mesh(config)
    if topology:
        log(f"{topology}: {len(chips)} chips from libtpu (no TPU attached: its warnings above about "
            "TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES are harmless)")
        mesh = topology_mesh(config, mesh, topology, chips)
    run = abstract_run(config, mesh, preset=preset, programs=programs, chip_bytes=CHIPS[chip])
    _log_sizing(run.workload, log)
    if not run.programs:
        raise ConfigError(f"bench memory --programs {','.join(programs)}: the run has none of them ("
                          + "; ".join(f"{k}: {v}" for k, v in run.not_compiled.items() if v != NOT_ASKED) + ")")
    log(f"{'program':<14}{'arguments':>11}{'outputs':>10}{'temps':>10}{'code':>8}{'held':>10}{'peak':>10}  "
        f"GiB per device ({len(mesh.devices.flat)} devices, {chip}{', ' + topology if topology else ''})")
    results = {}
    for name, (lowered, in_args) in run.programs.items():
        held = sum(v for part, v in run.resident.items() if part not in in_args)
        results[name] = compile_figures(lowered, held=held)
        log(_line(name, results[name]))
    hbm = CHIPS[chip]
    verdict, peak_program, peak, why = _verdict(results, chip)
    skipped = [name for name, why_not in run.not_compiled.items() if why_not == NOT_ASKED]
    if skipped:
        why += f"; only {', '.join(results)} compiled ({', '.join(skipped)} not asked: --programs)"
    host = {name: f["host_temp_bytes"] for name, f in results.items() if f.get("host_temp_bytes")}
    if host:
        why += "; host memory (offloaded, per chip): " + ", ".join(f"{n} {b / GIB:.2f} GiB" for n, b in host.items())
    log(why)
    where = {"devices": len(mesh.devices.flat), "mesh": dict(mesh.shape), "chip": chip, "hbm_bytes": hbm}
    if topology:
        where = {"topology": topology, "hosts": len({d.process_index for d in mesh.devices.flat}), **where}
        backend = f"tpu (compiled for {topology}, XLA:TPU)"
        note = (f"per chip; XLA:TPU's own buffer assignment for {topology} (libtpu's compiler, no TPU attached); a "
                "program it refused has compiled: false and the figures of its refusal")
    else:
        backend = jax.default_backend()
        note = "per device; XLA:CPU's buffer assignment for the run's shapes and shardings, not XLA:TPU's"
    note += "; flops and bytes_accessed count each loop's body once (layers, micro-batches, decode steps): a floor"
    return {**where, "model": run.model, "workload": run.workload, "resident_bytes": run.resident,
            "programs": results, "not_compiled": run.not_compiled, "peak_program": peak_program, "peak_bytes": peak,
            "margin_bytes": hbm - peak, "margin_frac": (hbm - peak) / hbm, "verdict": verdict, "verdict_line": why,
            "backend": backend, "note": note}


def _log_sizing(workload: dict, log: Callable[[str], None]) -> None:
    """How `sampling.kv_cache_bytes: auto` was sized for the chip, or why a run would stop."""
    from grpo_jax.engine.sizing import CacheSizing

    if "kv_cache" in workload:
        log(CacheSizing(**workload["kv_cache"]).line())
    if "kv_cache_refused" in workload:
        log(f"a run would stop at its start: {workload['kv_cache_refused']} (its sampler is measured without a pool)")


def _verdict(programs: dict, chip: str) -> tuple[str, str, int, str]:
    """(verdict, the program of the peak, the peak, the verdict's line): the largest peak against
    `chip`'s HBM; a program XLA:TPU refused does not fit whatever its figures say."""
    hbm = CHIPS[chip]
    peak_program = max(programs, key=lambda p: programs[p]["peak_bytes"])
    peak = programs[peak_program]["peak_bytes"]  # a refused program's: at least
    refused = sorted((p for p in programs if not programs[p]["compiled"]), key=lambda p: -programs[p]["peak_bytes"])
    verdict = "fits" if peak <= hbm and not refused else "does not fit"
    line = (f"{verdict} on {chip} ({hbm / GIB:.0f} GiB): peak {peak / GIB:.2f} GiB ({peak_program}), margin "
            f"{(hbm - peak) / GIB:.2f} GiB ({(hbm - peak) / hbm:.0%})")
    if refused:
        r = programs[refused[0]]
        need = (f"needs {r['required_bytes'] / GIB:.2f} GiB of {r['required_for']}, HBM "
                f"{r['hbm_available_bytes'] / GIB:.2f} GiB" if r["required_bytes"] else f"({r['error']})")
        line = (f"{verdict}: {refused[0]} {need} (XLA:TPU refused to compile {', '.join(refused)}); peak at least "
                f"{peak / GIB:.2f} GiB ({peak_program}) of {hbm / GIB:.0f} GiB")
    return verdict, peak_program, peak, line


def compile_figures(lowered, *, held: int) -> dict:
    """One lowered program compiled: `figures` of its memory, its FLOPs and bytes accessed per
    device (`cost_analysis()`), and `compiled: True`; or, where XLA:TPU refuses it for want of
    HBM, `refusal_figures` of its message and `compiled: False`."""
    from jax.errors import JaxRuntimeError

    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise
        return {"compiled": False, **refusal_figures(str(e), held=held),
                "compile_s": round(time.perf_counter() - t0, 2)}
    out = {"compiled": True, **figures(compiled.memory_analysis(), held=held, compile_s=time.perf_counter() - t0)}
    cost = compiled.cost_analysis() or {}
    out["flops"] = float(cost.get("flops", 0.0))
    out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return out


_SIZE = r"([0-9.]+)\s*([KMGTP]?)i?B?"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
# XLA:TPU: "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
# temporaries (42.58G) exceeds available HBM (15.75G)." Its "HLO temporaries" are the program's
# whole buffer assignment: a 20 GiB argument doubled into a new 20 GiB output reads "(40.00G)".
_REFUSAL = re.compile(rf"required for (.+?) \({_SIZE}\) exceeds available HBM \({_SIZE}\)")
# The other form XLA:TPU words it in: "Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G."
_REFUSAL_USED = re.compile(rf"Used {_SIZE} of {_SIZE} hbm")


def refusal_figures(message: str, *, held: int) -> dict:
    """What XLA:TPU's RESOURCE_EXHAUSTED `message` says a program needs (`required_bytes`, for
    `required_for`) and what HBM has for it (`hbm_available_bytes`: the chip's less what the
    runtime keeps), with `held` and `peak_bytes` (held + required, a lower bound)."""
    first = message.strip().splitlines()[0] if message.strip() else message
    out = {"error": first[:500], "held_bytes": int(held)}
    if m := _REFUSAL.search(message):
        what, need, avail = m.group(1), _bytes(m.group(2), m.group(3)), _bytes(m.group(4), m.group(5))
    elif m := _REFUSAL_USED.search(message):
        what, need, avail = "the program", _bytes(m.group(1), m.group(2)), _bytes(m.group(3), m.group(4))
    else:
        return {**out, "required_for": "(not stated)", "required_bytes": 0, "hbm_available_bytes": 0,
                "peak_bytes": int(held)}
    return {**out, "required_for": what, "required_bytes": need, "hbm_available_bytes": avail,
            "peak_bytes": int(held) + need}


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


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
    # `model.remat: offload` keeps each layer's input in the host's pinned memory between the
    # forward and the backward pass: host RAM per chip, not HBM (0 where nothing is offloaded).
    out["host_temp_bytes"] = int(getattr(a, "host_temp_size_in_bytes", 0) or 0)
    out["compile_s"] = round(compile_s, 2)
    return out


def _line(name: str, f: dict) -> str:
    if not f["compiled"]:
        return f"{name:<14}refused by XLA:TPU: {f['error']}"
    gib = [f[k] / GIB for k in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes",
                                "held_bytes", "peak_bytes")]
    return f"{name:<14}{gib[0]:>11.3f}{gib[1]:>10.3f}{gib[2]:>10.3f}{gib[3]:>8.3f}{gib[4]:>10.3f}{gib[5]:>10.3f}"


def topology_chip(topology: str, chip: str) -> str:
    """The chip a topology name is of (its part before ':'), which `chip`, if given, must be."""
    from grpo_jax.config import ConfigError

    family = re.split(r"[:=_]", topology, maxsplit=1)[0]
    if family not in CHIPS:
        raise ConfigError(f"bench memory: --topology {topology!r}: the chip before ':' must be one of {list(CHIPS)} "
                          f"(their HBM is known), e.g. {TOPOLOGY_EXAMPLES}")
    if chip and chip != family:
        raise ConfigError(f"bench memory: --chip {chip} but --topology {topology} is a {family} slice; leave --chip "
                          "out (the topology names its chip)")
    return family


def topology_devices(topology: str) -> list:
    """The compile-only TPU devices of `topology` from libtpu (no TPU needed, no backend started)."""
    from grpo_jax.config import ConfigError

    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        raise ConfigError(f"bench memory --topology compiles with XLA:TPU, which comes with libtpu; it is not "
                          f"installed: {INSTALL_TPU_COMPILER}. Without --topology, bench memory compiles with "
                          "XLA:CPU on host devices")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see the module docstring
    from jax.errors import JaxRuntimeError
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except JaxRuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"bench memory: libtpu refused --topology {topology!r}: {first} (names look like "
                          f"{TOPOLOGY_EXAMPLES})") from None
    except RuntimeError as e:  # jax finds no TPU plugin
        raise ConfigError(f"bench memory --topology needs XLA:TPU's plugin (libtpu): {e}; "
                          f"{INSTALL_TPU_COMPILER}") from None


def topology_mesh(config, host_mesh, topology: str, chips: Sequence):
    """The run's mesh over `topology`'s chips: the shape the config's checks gave `host_mesh` (over
    as many host devices), which must use every chip."""
    from grpo_jax.config import ConfigError
    from grpo_jax.runtime.sharding import make_mesh

    used = host_mesh.devices.size
    if used != len(chips):
        m, split = config.mesh, config.rollout.sampler_devices
        aside = f" (rollout.sampler_devices={split} of them go to the sampler: set it to 0)" if split else ""
        raise ConfigError(f"bench memory --topology {topology}: mesh.data x mesh.fsdp x mesh.expert x mesh.tensor = "
                          f"{m.data} x {m.fsdp} x {m.expert} x {m.tensor} uses {used} devices, the topology has "
                          f"{len(chips)} chips{aside}; "
                          "make the product match, or set one of them to -1")
    return make_mesh(config.mesh, chips)
