"""`grpo-jax plan`: the settings a run config should use on a TPU slice, found by compiling them.

Candidates: `train.micro_batches` (the divisors of the rows each micro-batch splits, up to 16:
the train step's rows per chip), `model.remat` (none, dots, attention, block, offload) and
`sampling.kv_cache_fraction` (0.9, 0.7, 0.5 of what is left of a chip for the page pool,
`sampling.kv_cache_bytes: auto`). Each candidate's step time is estimated (`estimate`) and the
candidates are compiled with XLA:TPU (libtpu, no TPU: grpo_jax.tools.bench.memory) from the
fastest estimate down until one fits every program with `MARGIN` of the chip's HBM to spare; the
sampler's settings and the train step's are independent programs, so each is searched on its own
and a program compiled once serves every candidate that shares its settings.

The estimate is a roofline, labelled as one: per program, max(FLOPs / peak FLOP/s, bytes / HBM
bandwidth) per chip, with the chip's published bf16 peak and bandwidth (`CHIP_PEAKS`). FLOPs are
the model's (grpo_jax.tools.flops: the same count as MFU) times the recompute of the remat policy;
bytes are the weights each pass reads, the optimizer's state, the KV cache each decode step reads,
and for `offload` the saved layer inputs to host memory and back (`HOST_BYTES_PER_S`). XLA's own
`cost_analysis()` of each compiled program is reported beside it, but it counts a loop's body once
(layers, micro-batches, decode steps), so it is a floor, not a step time. The decode loop's length
assumes every sequence runs to max_new_tokens (the worst case) in waves of what the pool holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from grpo_jax.tools.bench.memory import CHIPS, GIB

MARGIN = 0.2
"""The share of a chip's HBM a plan leaves unused in every program."""

CHIP_PEAKS = {"v5e": (197e12, 819e9), "v6e": (918e12, 1640e9), "v5p": (459e12, 2765e9)}
"""Per chip: (peak bf16 FLOP/s, HBM bytes/s), Cloud TPU's system architecture pages. float32
matmuls run at a quarter of the bf16 peak here (a documented rule of thumb for XLA:TPU's
multi-pass f32 matmuls, not a measurement)."""

HOST_BYTES_PER_S = 16e9
"""Host-to-HBM bandwidth per chip assumed for `model.remat: offload` (PCIe-class; an estimate)."""

REMATS = ("none", "dots", "attention", "block", "offload")
FRACTIONS = (0.9, 0.7, 0.5)
MAX_MICRO_BATCHES = 16


@dataclasses.dataclass(frozen=True)
class Sampler:
    kv_cache_fraction: float

    def sets(self) -> list[str]:
        return ["sampling.kv_cache_bytes=auto", f"sampling.kv_cache_fraction={self.kv_cache_fraction}"]


@dataclasses.dataclass(frozen=True)
class Update:
    micro_batches: int
    remat: str

    def sets(self) -> list[str]:
        return [f"train.micro_batches={self.micro_batches}", f"model.remat={self.remat}"]


def micro_batch_choices(config) -> list[int]:
    """The micro-batch counts the config's batch splits into on its mesh (`check_devices`), fewest
    first, up to `MAX_MICRO_BATCHES`."""
    from grpo_jax.config import ConfigError
    from grpo_jax.runtime.devices import check_devices

    got = []
    for m in range(1, MAX_MICRO_BATCHES + 1):
        try:
            check_devices(_with(config, [f"train.micro_batches={m}"]))
        except (ConfigError, ValueError):
            continue
        got.append(m)
    return got


def _peak(chip: str, dtype: str) -> tuple[float, float]:
    flops, bw = CHIP_PEAKS[chip]
    return (flops if dtype == "bfloat16" else flops / 4), bw


def _recompute(cfg, remat: str) -> float:
    """The forward FLOPs the backward pass recomputes, as a share of the forward's layers."""
    H, K, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    sparse = len(cfg.sparse_layers)
    mlp = (sparse * 3 * cfg.moe_intermediate_size * cfg.num_experts_per_tok + (cfg.num_layers - sparse) * 3 * F
           ) / cfg.num_layers
    projections = (H + 2 * K) * D + H * D
    return {"none": 0.0, "dots": 0.0, "attention": mlp / (mlp + projections), "block": 1.0, "offload": 1.0}[remat]


def estimate_update(config, cfg, update: Update, *, chips: int, chip: str, held: int) -> dict:
    """Seconds of the train step (and the reference pass) per the roofline (module docstring)."""
    from grpo_jax.tools.flops import forward_flops

    s, d = config.sampling, config.data
    N, G, P, M = d.prompts_per_step, s.group_size, max(s.prompt_buckets), s.max_new_tokens
    peak, bw = _peak(chip, config.model.dtype)
    if config.train.shared_prompt:
        fwd = forward_flops(cfg, rows=N, start=0, count=P, logits=0) + forward_flops(cfg, rows=N * G, start=P,
                                                                                      count=M, logits=M)
    else:
        fwd = forward_flops(cfg, rows=N * G, start=0, count=P + M, logits=M)
    r = _recompute(cfg, update.remat)
    size = 2 if config.model.dtype == "bfloat16" else 4
    weights = _weights(cfg) * size / max(config.mesh.tensor, 1)
    tokens_per_chip = N * G * (P + M) / chips
    # Forward, backward (twice the forward), recompute; the weights read by each pass of each
    # micro-batch; the optimizer reads and writes the state once.
    flops = (3 + r) * fwd * config.grpo.num_iterations / chips
    passes = 3 + (1 if r else 0)
    bytes_ = (passes * update.micro_batches * weights + 2 * held) * config.grpo.num_iterations
    seconds = max(flops / peak, bytes_ / bw)
    if update.remat == "offload":  # each layer's input out to the host and back
        seconds += 2 * cfg.num_layers * tokens_per_chip * cfg.hidden_size * size / HOST_BYTES_PER_S
    reference = 0.0
    if config.grpo.beta > 0:
        reference = max(fwd / chips / peak, update.micro_batches * weights / bw)
    return {"update_s": seconds, "reference_s": reference, "flops_per_chip": flops, "bytes_per_chip": bytes_}


def estimate_sampler(config, cfg, sampling, *, chips: int, chip: str, shards: int) -> dict:
    """Seconds of the sampler per the roofline: the prefill, then max_new_tokens decode steps per
    wave of the sequences the pool holds at full length (module docstring)."""
    from grpo_jax.engine.pages import page_bytes
    from grpo_jax.tools.flops import forward_flops

    d = config.data
    N, G, P, M = d.prompts_per_step, sampling.group_size, max(sampling.prompt_buckets), sampling.max_new_tokens
    peak, bw = _peak(chip, config.model.dtype)
    size = 2 if config.model.dtype == "bfloat16" else 4
    per_token = page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, size)
    rows = N * G // shards  # per row shard
    pool = sampling.kv_bytes
    at_once = rows if not pool else max(1, min(rows, pool // per_token // (P + M)))
    waves = math.ceil(rows / at_once)
    weights = _weights(cfg) * size / max(config.mesh.tensor, 1)
    step_flops = forward_flops(cfg, rows=at_once, start=P + M // 2, count=1, logits=1) * shards / chips
    step_bytes = weights + at_once * (P + M // 2) * per_token
    decode = waves * M * max(step_flops / peak, step_bytes / bw)
    prefill = max(forward_flops(cfg, rows=N, start=0, count=P, logits=1) / chips / peak, weights / bw)
    return {"sampler_s": prefill + decode, "sequences_at_once": at_once, "waves": waves}


def _weights(cfg) -> int:
    """Parameters of the model (embeddings, layers, head)."""
    E, H, K, D, F, V, L = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                           cfg.vocab_size, cfg.num_layers)
    sparse = len(cfg.sparse_layers)
    mlp = sparse * (3 * E * cfg.moe_intermediate_size * cfg.num_experts + E * cfg.num_experts) + (L - sparse) * 3 * E * F
    head = 0 if cfg.tie_word_embeddings else V * E
    return V * E + head + L * (E * (H + 2 * K) * D + H * D * E) + mlp


def plan(config_path: str, *, topology: str, overrides: Sequence[str] = (), preset: str = "", max_compiles: int = 12,
         log: Callable[[str], None] | None = None) -> dict:
    """`grpo-jax plan`: the plan for a run config on a TPU slice `topology` (e.g. "v5e:2x4"), its
    programs compiled by XLA:TPU on compile-only devices (libtpu; no TPU). JAX must run on as many
    host devices as the slice has chips: in a process where JAX has not started this sets it up,
    else the plan runs in a child process (as `bench memory --topology` does). `preset`: the
    model's shape by name (`bench.PRESETS`) where its files are not on this machine."""
    import os
    import sys

    import grpo_jax
    from grpo_jax.config import ConfigError, load_config
    from grpo_jax.tools.bench.memory import host_devices_ready, to_stderr, topology_chip, topology_devices

    if not topology:
        raise ConfigError("plan needs --topology, the TPU slice to plan for (e.g. v5e:2x4)")
    chip = topology_chip(topology, "")
    config = load_config(config_path, overrides)
    fresh = "jax" not in sys.modules
    if fresh:
        os.environ["JAX_PLATFORMS"] = "cpu"
    chips = topology_devices(topology)
    if not host_devices_ready(len(chips), fresh):
        return _in_child(config_path, topology=topology, overrides=overrides, preset=preset,
                         max_compiles=max_compiles)
    result = plan_in_process(config, chip=chip, topology=topology, chips=chips, log=log or to_stderr,
                             preset=preset, max_compiles=max_compiles)
    return {"system": "grpo_jax", "version": grpo_jax.__version__, "config": str(config_path),
            "overrides": list(overrides), **result}


_CHILD = "GRPO_JAX_PLAN_CHILD"


def _in_child(config_path: str, *, topology: str, overrides: Sequence[str], preset: str, max_compiles: int) -> dict:
    """`grpo-jax plan` in a fresh process (JAX cannot change its device count once started)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from grpo_jax.config import ConfigError

    if os.environ.get(_CHILD):
        raise ConfigError("plan: JAX was already started in its own process, so it could not run on the topology's "
                          "chips' count of host devices")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [sys.executable, "-m", "grpo_jax", "plan", "--config", str(config_path), "--topology", topology,
               "--max-compiles", str(max_compiles), "--output", out, *([f"--preset={preset}"] if preset else []),
               *(f"--set={o}" for o in overrides)]
        done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, env={**os.environ, _CHILD: "1"})
        if not os.path.exists(out):
            raise ConfigError(f"plan for {topology} failed in its own process (exit status {done.returncode}; its "
                              "message is above)")
        with open(out) as f:
            return json.load(f)


def plan_in_process(config, *, chip: str, topology: str, chips: Sequence, log: Callable[[str], None],
                    preset: str = "", max_compiles: int = 12) -> dict:
    """The plan for `config` on `topology`'s compile-only `chips` (this process runs JAX on as many
    host devices): see the module docstring. Returns the JSON fields."""
    import jax

    from grpo_jax.config import ConfigError
    from grpo_jax.runtime.devices import check_devices, run_mesh
    from grpo_jax.tools.bench.abstract_run import model_shape
    from grpo_jax.tools.bench.memory import topology_mesh

    if config.parallelism != "jit":
        raise ConfigError("plan: parallelism must be jit (a pod runs jit)")
    check_devices(config)
    planner = _Planner(config=config, chip=chip, mesh=topology_mesh(config, run_mesh(config), topology, chips),
                       cfg=model_shape(config.model, preset)[0], preset=preset, log=log, max_compiles=max_compiles)
    # A compile-only topology's executables cannot be loaded back from JAX's persistent cache (no
    # client): reading an entry a run of the same settings wrote only warns, so none is read here.
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        samplers = planner.search_sampler()
        updates = planner.search_update()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    hbm = CHIPS[chip]
    result = {"topology": topology, "chip": chip, "chips": len(chips), "hbm_bytes": hbm, "margin": MARGIN,
              "estimate": "roofline (grpo_jax.tools.plan): max(FLOPs / peak, bytes / HBM bandwidth) per program, "
                          "published chip peaks; not a measurement",
              "sampler_candidates": samplers, "update_candidates": updates}
    sampler = next((s for s in samplers if s["fits"]), None)
    update = next((u for u in updates if u["fits"]), None)
    if sampler is None or update is None:
        missing = " and ".join(w for w, got in (("the sampler", sampler), ("the train step", update)) if got is None)
        result.update(fits=False, line=f"plan: no candidate compiled for {missing} fits {1 - MARGIN:.0%} of a {chip} "
                                       f"chip's {hbm / GIB:.2f} GiB within {max_compiles} compiles; shard over more "
                                       "chips, lower data.prompts_per_step or the lengths")
        log(result["line"])
        return result
    sets = sampler["sets"] + update["sets"]
    step = sampler["sampler_s"] + update["update_s"] + update["reference_s"]
    result.update(fits=True, sets=sets, estimated_step_s=step, snippet=_snippet(sets),
                  line=f"plan: estimated step {step:.3g} s (roofline estimate) with " + " ".join(f"--set {s}" for s in sets))
    log(result["line"])
    log("as config:\n" + result["snippet"])
    return result


@dataclasses.dataclass
class _Planner:
    """The search's state: programs compiled so far (one compile per distinct setting)."""

    config: object
    chip: str
    mesh: object
    cfg: object
    preset: str
    log: Callable[[str], None]
    max_compiles: int
    compiled: dict = dataclasses.field(default_factory=dict)
    held: int = 0  # what the run holds per chip while sampling (the abstract run's resident parts)

    @property
    def budget(self) -> float:
        return (1 - MARGIN) * CHIPS[self.chip]

    def programs_of(self, config, names: tuple[str, ...], key: tuple) -> dict:
        """Compile `names` of `config` once per `key` -> {"programs": name -> figures, workload, resident}."""
        from grpo_jax.tools.bench.abstract_run import abstract_run
        from grpo_jax.tools.bench.memory import compile_figures

        if key not in self.compiled:
            if sum(len(v["programs"]) for v in self.compiled.values()) >= self.max_compiles:
                raise _Budget
            run = abstract_run(config, self.mesh, preset=self.preset, programs=names, chip_bytes=CHIPS[self.chip])
            figures = {}
            for name, (lowered, in_args) in run.programs.items():
                held = sum(v for part, v in run.resident.items() if part not in in_args)
                figures[name] = compile_figures(lowered, held=held)
            self.compiled[key] = {"programs": figures, "workload": run.workload, "resident": run.resident}
        return self.compiled[key]

    def fits(self, got: dict) -> bool:
        return "kv_cache_refused" not in got["workload"] and all(
            f["compiled"] and f["peak_bytes"] <= self.budget for f in got["programs"].values())

    def search_sampler(self) -> list[dict]:
        """The pool fractions, largest (fastest: fewer waves) first, until one fits."""
        from grpo_jax.runtime.sharding import rows_per_shard

        tried = []
        for frac in FRACTIONS:
            cand = Sampler(frac)
            c = _with(self.config, cand.sets())
            try:
                got = self.programs_of(c, ("sampler", "eval_sampler"), ("sampler", frac))
            except _Budget:
                break
            self.held = sum(v for k, v in got["resident"].items() if not k.startswith("batch"))
            est = estimate_sampler(c, self.cfg, _sized(c, got), chips=self.mesh.devices.size, chip=self.chip,
                                   shards=rows_per_shard(self.mesh))
            ok = self.fits(got)
            tried.append({"sets": cand.sets(), "fits": ok, **est, "programs": _brief(got["programs"]),
                          "kv_cache": got["workload"].get("kv_cache"),
                          "refused": got["workload"].get("kv_cache_refused")})
            self.log(_row("sampler", cand.sets(), est["sampler_s"], got["programs"], ok, self.budget))
            if ok:
                break
        return tried

    def search_update(self) -> list[dict]:
        """(micro-batches, remat) by estimated time, fastest first, until one fits."""
        n = self.mesh.devices.size

        def estimate(c, u):
            return estimate_update(c, self.cfg, u, chips=n, chip=self.chip, held=self.held)

        order = sorted((Update(m, r) for m in micro_batch_choices(self.config) for r in REMATS),
                       key=lambda u: estimate(self.config, u)["update_s"])
        names = ("train_step", "reference") if self.config.grpo.beta > 0 else ("train_step",)
        tried = []
        for cand in order:
            c = _with(self.config, cand.sets())
            try:
                got = self.programs_of(c, names, ("update", cand.micro_batches, cand.remat))
            except _Budget:
                break
            est, ok = estimate(c, cand), self.fits(got)
            tried.append({"sets": cand.sets(), "fits": ok, **est, "programs": _brief(got["programs"])})
            self.log(_row("update", cand.sets(), est["update_s"] + est["reference_s"], got["programs"], ok,
                          self.budget))
            if ok:
                break
        return tried


class _Budget(Exception):
    """The compile budget is spent."""


def _with(config, sets: Sequence[str]):
    """`config` with `--set` lines applied (and checked)."""
    from grpo_jax.config import apply_overrides, config_from_dict, config_to_dict

    return config_from_dict(apply_overrides(config_to_dict(config), sets))


def _sized(config, got: dict):
    """The sampler's settings as the compiled program had them (auto resolved for the chip)."""
    kv = got["workload"].get("kv_cache")
    s = config.sampling
    if kv is None:
        return dataclasses.replace(s, kv_cache_bytes=s.kv_bytes)
    return dataclasses.replace(s, kv_cache_bytes=kv["pool"], slots=kv["slots"])


def _brief(programs: dict) -> dict:
    return {n: {k: f.get(k) for k in ("compiled", "peak_bytes", "temp_bytes", "flops", "bytes_accessed")}
            for n, f in programs.items()}


def _row(what: str, sets: Sequence[str], seconds: float, programs: dict, ok: bool, budget: float) -> str:
    peaks = ", ".join(f"{n} {f['peak_bytes'] / GIB:.2f} GiB" + ("" if f["compiled"] else " (refused)")
                      for n, f in programs.items())
    return (f"{what:<8}{' '.join(sets):<62} est. {seconds:9.3g} s  {peaks}  "
            f"{'fits' if ok else 'over'} {budget / GIB:.2f} GiB")


def _snippet(sets: Sequence[str]) -> str:
    """The `--set` lines as YAML sections."""
    sections: dict[str, list[str]] = {}
    for s in sets:
        key, value = s.split("=", 1)
        section, name = key.split(".", 1)
        sections.setdefault(section, []).append(f"  {name}: {value}")
    return "\n".join(f"{section}:\n" + "\n".join(lines) for section, lines in sections.items())
