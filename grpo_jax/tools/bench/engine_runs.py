"""The rollout engines `grpo-jax bench engine` times, on one workload (a run config's model and
prompts), each as a callable that runs the whole workload once and returns its `EngineRun`:

- `static_batched`: the static engine on `slots / G` prompts (`slots` rows) at a time, one batch
  after another: the most a chip holds when its KV-cache budget is that of `slots` rows;
- `static_all`: the static engine on every row at once (the default engine before round 4);
- `continuous`: the paged engine with `slots` decode slots over all sequences, each with one
  max-length reservation (`sampling.engine: continuous`, the per-slot engine's settings);
- `paged`: the paged engine with those reservations' cache bytes as its page pool and
  `paged_slots` decode slots (the pool, not the slots, bounds how many run at once).

Beside them, what the figures need: each engine's prompt pass as a jitted prefill-only call, and
its KV-cache bytes from the shapes of its own cache (`jax.eval_shape` of the calls that build it,
nothing allocated). Shape letters: grpo_jax.shapes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config import ConfigError, SamplingConfig, load_config
from grpo_jax.models import Transformer
from grpo_jax.engine.slots import SlotCache
from grpo_jax.engine.engines import engine_of
from grpo_jax.engine.pages import page_bytes, pages_needed
from grpo_jax.engine.paged import paged_program
from grpo_jax.engine.state import engine_layout
from grpo_jax.engine.sampling import generate, pad_prompts
from grpo_jax.runtime.sharding import one_device_mesh
from grpo_jax.models.build import build_model
from grpo_jax.trainer.prepare import prepare

ENGINES = ("static_batched", "static_all", "continuous", "paged")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call's work: the model, the run's sampling settings (stop and pad ids resolved), the
    first batch of the run's prompts (each token-id list, and left-padded ids/mask [N, P]), a key."""

    model: Transformer
    sampling: SamplingConfig
    prompts: list[list[int]]
    ids: np.ndarray
    mask: np.ndarray
    seed: int  # train.seed: the model's initialisation and the rollouts' key
    description: dict

    @property
    def key(self) -> jax.Array:
        return jax.random.key(self.seed)

    @property
    def slots(self) -> int:
        return self.sampling.slots

    @property
    def rows(self) -> int:
        return self.ids.shape[0] * self.sampling.group_size


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """What one run of the workload gave: the rollout's lengths and truncation flags [R], the
    draw steps it ran, and the slot-steps they took (rows x steps; None where not counted)."""

    lengths: np.ndarray
    truncated: np.ndarray
    draw_steps: int
    slot_steps: int | None
    engine_useful_slot_steps: int | None = None  # the paged engine's own count
    prefill_rows: int | None = None
    paging: dict | None = None  # the paged engine's: preemptions, recomputed tokens, pages used


def load_workload(config_path: str, overrides: Sequence[str]) -> Workload:
    """The config's model (`model.path` or `model.architecture` from `train.seed`), its first
    `data.prompts_per_step` training prompts, its resolved sampling settings; `sampling.slots`
    must be a positive multiple of the group size (the static batches are whole groups)."""
    config = load_config(config_path, overrides)
    prepared = prepare(config)
    s = prepared.rollout.sampling
    if s.slots <= 0 or s.slots % s.group_size:
        raise ConfigError(f"bench engine compares engines at a KV budget of sampling.slots rows: set "
                          f"sampling.slots to a positive multiple of the group size {s.group_size}, got {s.slots}")
    examples = prepared.rollout.stream.next_batch(config.data.prompts_per_step)
    prompts = [list(e.prompt_ids) for e in examples]
    ids, mask = pad_prompts(prompts, s.prompt_buckets, s.pad_id)
    model = build_model(config.model, prepared.model.config, config.train.seed)
    mc = prepared.model.config
    description = {
        "model": config.model.path or f"random {mc.family}: {mc.num_layers} layers, hidden {mc.hidden_size}, "
                                      f"vocab {mc.vocab_size} (train.seed {config.train.seed})",
        "seed": config.train.seed, "dtype": config.model.dtype, "prompts": len(prompts), "group_size": s.group_size,
        "rows": len(prompts) * s.group_size,
        "prompt_bucket": int(ids.shape[1]), "prompt_tokens_mean": float(mask.sum(axis=1).mean()),
        "max_new_tokens": s.max_new_tokens, "min_new_tokens": s.min_new_tokens, "temperature": s.temperature,
        "top_k": s.top_k, "top_p": s.top_p, "stop_token_ids": list(s.stop_token_ids), "slots": s.slots,
        "attend_phases": s.attend_phases, "vocab_size": mc.vocab_size}
    return Workload(model=model, sampling=s, prompts=prompts, ids=ids, mask=mask, seed=config.train.seed,
                    description=description)


def _static(w: Workload, prompts_per_call: int) -> Callable[[], EngineRun]:
    """The static engine over the prompts `prompts_per_call` at a time, the calls one after another."""
    config = dataclasses.replace(w.sampling, engine="static")
    N = w.ids.shape[0]
    spans = [(a, min(a + prompts_per_call, N)) for a in range(0, N, prompts_per_call)]
    parts = [(jnp.asarray(w.ids[a:b]), jnp.asarray(w.mask[a:b])) for a, b in spans]

    def run() -> EngineRun:
        outs = [generate(w.model, part, config, jax.random.fold_in(w.key, i)) for i, part in enumerate(parts)]
        outs = jax.block_until_ready(outs)
        lengths = [np.asarray(o.lengths) for o in outs]
        # A call draws until its longest row is done: max(lengths) steps of all its rows.
        steps = [int(x.max()) for x in lengths]
        truncated = np.concatenate([np.asarray(o.truncated) for o in outs])
        return EngineRun(lengths=np.concatenate(lengths), truncated=truncated,
                         draw_steps=sum(steps), slot_steps=sum(len(x) * s for x, s in zip(lengths, steps)))

    return run


def _continuous(w: Workload) -> Callable[[], EngineRun]:
    """The jitted program `generate` runs for engine continuous (the paged engine, one reservation per
    slot), for its stats."""
    config = dataclasses.replace(w.sampling, engine="continuous")
    ids, mask = jnp.asarray(w.ids), jnp.asarray(w.mask)

    def run() -> EngineRun:
        graphdef, state = nnx.split(w.model)  # as generate does on every call
        program = engine_of(config).program(graphdef, config, one_device_mesh())
        rollout, stats = jax.block_until_ready(program(state, ids, mask, w.key))
        return EngineRun(lengths=np.asarray(rollout.lengths), truncated=np.asarray(rollout.truncated),
                         draw_steps=int(stats["steps"]), slot_steps=int(stats["slot_steps"]),
                         engine_useful_slot_steps=int(stats["useful_slot_steps"]),
                         prefill_rows=int(stats["prefill_rows"]))

    return run


def _paged(w: Workload, slots: int, cache_bytes: int) -> Callable[[], EngineRun]:
    """The paged engine's jitted program with a pool of `cache_bytes` and `slots` decode slots."""
    config = dataclasses.replace(w.sampling, engine="paged", slots=slots, kv_cache_bytes=cache_bytes)
    ids, mask = jnp.asarray(w.ids), jnp.asarray(w.mask)

    def run() -> EngineRun:
        graphdef, state = nnx.split(w.model)
        rollout, stats = jax.block_until_ready(paged_program(graphdef, config, one_device_mesh())(state, ids, mask,
                                                                                                   w.key))
        st = {k: int(v) for k, v in stats.items()}
        paging = {"slots": slots, "page_size": config.page_size, "pool_pages": st["pool_pages"],
                  "preemptions": st["preemptions"], "recomputed_tokens": st["recomputed_tokens"],
                  # None: the call ran the lock-step loop, which has no pages.
                  "pages_used_frac": (round(st["page_steps"] / (st["steps"] * st["pool_pages"] * st["shards"]), 4)
                                      if st["pool_pages"] else None),
                  "pages_peak_frac": round(st["pages_peak"] / st["pool_pages"], 4) if st["pool_pages"] else None}
        return EngineRun(lengths=np.asarray(rollout.lengths), truncated=np.asarray(rollout.truncated),
                         draw_steps=st["steps"], slot_steps=st["slot_steps"],
                         engine_useful_slot_steps=st["useful_slot_steps"], prefill_rows=st["prefill_rows"],
                         paging=paging)

    return run


def engine_runners(w: Workload, paged_slots: int) -> dict[str, Callable[[], EngineRun]]:
    """ENGINES -> a callable that runs the whole workload once with that engine; the paged engine's
    pool holds the continuous engine's cache bytes."""
    return {"static_batched": _static(w, w.slots // w.sampling.group_size),
            "static_all": _static(w, w.ids.shape[0]), "continuous": _continuous(w),
            "paged": _paged(w, paged_slots, kv_cache_bytes(w)["continuous"]["total"])}


def _prompt_passes(w: Workload):
    """(static engine's prompt pass, continuous engine's) as jitted `(state, ids, mask)` calls that
    return the last logits and the prompts' keys/values; the static cache's empty generated
    chunks are left out (XLA drops them), so this is the prompt pass alone, not the cache's zeroing."""
    graphdef, _ = nnx.split(w.model)
    s = w.sampling

    @jax.jit
    def static_pass(state, ids, mask):
        # grpo_jax.engine.sampling's prefill call, as the static engine makes it.
        logits, cache = nnx.merge(graphdef, state).prefill(ids, mask, group_size=s.group_size,
                                                           decode_steps=s.max_new_tokens - 1,
                                                           chunks=s.attend_phases, last_only=True)
        return logits, cache.prompt_keys, cache.prompt_values

    @jax.jit
    def slot_pass(state, ids, mask):
        return nnx.merge(graphdef, state).prefill_kv(ids, mask)[:3]

    return static_pass, slot_pass


def prefill_runners(w: Workload) -> dict[str, Callable[[], None]]:
    """ENGINES -> a callable that runs that engine's prompt passes of the workload once (the
    static batches one after another)."""
    static_pass, slot_pass = _prompt_passes(w)
    N, per = w.ids.shape[0], w.slots // w.sampling.group_size

    def runner(fn, step):
        parts = [(jnp.asarray(w.ids[a:a + step]), jnp.asarray(w.mask[a:a + step])) for a in range(0, N, step)]

        def run():
            _, state = nnx.split(w.model)
            jax.block_until_ready([fn(state, *part) for part in parts])
        return run

    return {"static_batched": runner(static_pass, per), "static_all": runner(static_pass, N),
            "continuous": runner(slot_pass, N), "paged": runner(slot_pass, N)}


def _nbytes(arrays) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(arrays)))


def kv_cache_bytes(w: Workload) -> dict[str, dict[str, int]]:
    """ENGINES -> {"prompt", "generated", "total"}: bytes of the keys and values of the cache each
    engine holds at once (a static batch's; every prompt's block and the slots' for the
    continuous engine), from the shapes of the calls that build it (`jax.eval_shape`)."""
    graphdef, state = nnx.split(w.model)
    s, P = w.sampling, w.ids.shape[1]
    N = w.ids.shape[0]

    def static_cache(n):
        ids = jax.ShapeDtypeStruct((n, P), jnp.int32)
        cache = jax.eval_shape(lambda st, i: nnx.merge(graphdef, st).prefill(
            i, i, group_size=s.group_size, decode_steps=s.max_new_tokens - 1, chunks=s.attend_phases,
            last_only=True)[1], state, ids)
        return _nbytes((cache.prompt_keys, cache.prompt_values)), _nbytes((cache.keys, cache.values))

    def slot_cache():
        ids = jax.ShapeDtypeStruct((N, P), jnp.int32)
        slots = engine_layout(N, s, one_device_mesh()).slots
        # The per-slot cache grpo_jax.engine.paged builds (its decode_steps: max_new_tokens - 1, at least 1).
        cache = jax.eval_shape(lambda st, i: SlotCache.create(
            *nnx.merge(graphdef, st).prefill_kv(i, i)[1:], shards=1, slots=slots,
            decode_steps=max(s.max_new_tokens - 1, 1), phases=s.attend_phases), state, ids)
        return _nbytes((cache.prompt_keys, cache.prompt_values)), _nbytes((cache.keys, cache.values))

    shapes = {"static_batched": static_cache(min(N, w.slots // s.group_size)), "static_all": static_cache(N),
              "continuous": slot_cache()}
    out = {k: {"prompt": p, "generated": g, "total": p + g} for k, (p, g) in shapes.items()}
    # The paged engine's pool: the continuous engine's bytes in whole pages (prompt region + pool).
    mc = w.model.config
    page = page_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, s.page_size, jnp.dtype(w.model.dtype).itemsize)
    prompt = (1 + N * pages_needed(P, s.max_new_tokens, s.page_size)[0]) * page
    total = out["continuous"]["total"] // page * page
    out["paged"] = {"prompt": prompt, "generated": total - prompt, "total": total}
    return out


def time_interleaved(runners: dict[str, Callable], iters: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Each runner once (its first call: compilation and a run, timed apart), then `iters`
    rounds of every runner in turn, so that noise from elsewhere on the machine hits them alike.
    -> name -> {"first_s", "times" (seconds of the timed calls), "result" (the last call's)}."""
    out = {}
    for name, fn in runners.items():
        t = time.perf_counter()
        result = fn()
        out[name] = {"first_s": time.perf_counter() - t, "times": [], "result": result}
        log(f"bench engine: {name} first call (compile + run) {out[name]['first_s']:.2f} s")
    for i in range(iters):
        for name, fn in runners.items():
            t = time.perf_counter()
            out[name]["result"] = fn()
            out[name]["times"].append(time.perf_counter() - t)
        log(f"bench engine: round {i + 1}/{iters}: " + ", ".join(
            f"{name} {v['times'][-1]:.2f} s" for name, v in out.items()))
    return out


def length_stats(lengths: np.ndarray, truncated: np.ndarray, max_new_tokens: int) -> dict:
    """The completion lengths' distribution: mean, percentiles, and the shares that reached
    max_new_tokens and that were truncated (no stop token)."""
    x = np.asarray(lengths, np.float64)
    return {"mean": float(x.mean()), "p10": float(np.percentile(x, 10)), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "max": int(x.max()), "min": int(x.min()),
            "share_at_max_new_tokens": float((x >= max_new_tokens).mean()),
            "share_truncated": float(np.asarray(truncated).mean())}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))
