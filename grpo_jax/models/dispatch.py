"""Which attention implementation runs each pass of a run.

Every implementation declares what it supports (`Implementation`): the platforms it runs on, the
passes it can run (`PASSES`), a sliding window, soft-capping, and shape rules (head_dim, heads,
page size). A pass says what it asks (`Need`: its platform, the model's features, its shapes).
`pick` answers a choice for a pass: `"auto"` is the first implementation of the platform's
fastest-first order (`auto_order`) that supports the pass; an explicit choice that cannot run it
is refused in one line naming a choice that can. `run_needs` lists the passes a run's config will
ask for, so `grpo-jax check` and a run's start refuse a choice before anything compiles.

Two families: `MODEL`, `model.attention`'s implementations for the training, reference and
prefill passes (grpo_jax.models.attention), and `DECODE`, `sampling.paged_attention`'s for the
paged engine's decode step (grpo_jax.engine.paged_decode). Every implementation here is exact
(tests compare each with the XLA reference); they differ in speed and in what they can express.

Passes: "plain" (queries and keys are one sequence layout: a row of left-padded prompt and
completion, or packed segments compared by equality), "shared_prompt" (a completion's queries over
its prompt's keys, then its own: keys before the queries), "packed" (packed segments whose
completions also see a parent segment, their shared prompt), "decode" (one query per sequence over
its cache pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

PASSES = ("plain", "shared_prompt", "packed", "decode")
PASS_WORDS = {"plain": "the plain pass", "shared_prompt": "the shared-prompt pass (keys before the queries)",
              "packed": "packed segments with parent segments", "decode": "the decode step"}
ALL = frozenset({"cpu", "gpu", "tpu"})

AUTO_XLA_MAX_KEYS = 256
"""`attention: auto` on CPU runs plain XLA attention up to this many key slots, the chunked
(flash-style) path above it: the two are even at 256 tokens, and chunked is 1.9x faster at 512
and 2.6x at 4,096 (forward + backward; benchmarks/results/attention/cpu.json)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Need:
    """What one pass asks of an attention implementation."""

    name: str  # one of PASSES
    platform: str  # "cpu", "gpu" or "tpu"
    keys: int = 0  # key slots of the pass (CPU's auto order depends on it)
    window: bool = False  # some layer has a sliding window
    softcap: bool = False  # scores are soft-capped
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 128
    mesh: bool = True  # the pass runs with its mesh (a Pallas kernel runs per device under shard_map)
    page_size: int = 16  # decode only
    dtype_bytes: int = 4  # decode only: the cache's element size

    def __post_init__(self):
        if self.name not in PASSES:
            raise ValueError(f"unknown pass {self.name!r}: one of {PASSES}")
        if self.platform not in ALL:
            raise ValueError(f"unknown platform {self.platform!r}: one of {sorted(ALL)}")


def model_need(name: str, cfg, platform: str, *, keys: int = 0, mesh: bool = True) -> Need:
    """The `Need` of pass `name` of a model with config `cfg` (a TransformerConfig)."""
    return Need(name=name, platform=platform, keys=keys, mesh=mesh, softcap=cfg.attn_logit_softcap is not None,
                window=any(cfg.window_of(k) is not None for k in cfg.kinds), heads=cfg.num_heads,
                kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
    """What one implementation can run."""

    name: str
    platforms: frozenset[str]
    passes: frozenset[str]
    window: bool = True
    softcap: bool = True
    kernel: bool = False  # a Pallas kernel: per device under shard_map, interpreted on CPU
    shapes: Callable[[Need], str | None] | None = None  # a shape rule: why not, or None
    about: str = ""

    def refuses(self, need: Need) -> str | None:
        """Why this implementation cannot run `need` (a phrase), or None when it can."""
        if need.platform not in self.platforms:
            return f"runs on {' or '.join(sorted(self.platforms))}, and this run's devices are {need.platform}"
        if need.name not in self.passes:
            return f"cannot run {PASS_WORDS[need.name]}"
        if need.window and not self.window:
            return "has no sliding window (the model has sliding-window layers)"
        if need.softcap and not self.softcap:
            return "has no soft-capping (the model soft-caps its attention scores)"
        if self.kernel and not need.mesh:
            return "runs per device under shard_map, and this pass is not given its mesh"
        return self.shapes(need) if self.shapes is not None else None


def _tpu_pages(need: Need) -> str | None:
    packing = max(4 // need.dtype_bytes, 1)
    heads = 2 * need.kv_heads // packing
    if need.head_dim % 128:
        return f"needs head_dim % 128 == 0 (the model's is {need.head_dim})"
    if not (heads in (1, 2, 4, 8) or heads % 8 == 0):
        return f"cannot tile {need.kv_heads} key/value heads"
    if need.page_size % 8:
        return f"needs sampling.page_size % 8 == 0 (it is {need.page_size})"
    return None


def _gpu_pages(need: Need) -> str | None:
    if need.head_dim < 16 or need.head_dim & (need.head_dim - 1):
        return f"needs head_dim a power of two >= 16 (the model's is {need.head_dim})"
    if need.page_size < 16 or need.page_size & (need.page_size - 1):
        return f"needs sampling.page_size a power of two >= 16 (it is {need.page_size})"
    return None


_MODEL_PASSES = frozenset({"plain", "shared_prompt", "packed"})

MODEL = {
    "xla": Implementation(name="xla", platforms=ALL, passes=_MODEL_PASSES,
                          about="plain XLA attention, scores [B, H, T, S] (the reference)"),
    "chunked": Implementation(name="chunked", platforms=ALL, passes=_MODEL_PASSES,
                              about="flash-style online softmax in pure JAX, O(T x block) memory"),
    "splash": Implementation(name="splash", platforms=frozenset({"tpu"}), passes=frozenset({"plain", "shared_prompt"}),
                             kernel=True, about="JAX's Pallas TPU kernel (splash attention)"),
    "gpu": Implementation(name="gpu", platforms=frozenset({"gpu"}), passes=frozenset({"plain"}), window=False,
                          softcap=False, kernel=True, about="JAX's Pallas GPU (Triton) flash kernel"),
}
"""`model.attention`'s implementations (grpo_jax.models.attention.IMPLS)."""

DECODE = {
    "gather": Implementation(name="gather", platforms=ALL, passes=frozenset({"decode"}),
                             about="pure JAX: each sequence's pages gathered, then attended"),
    "pallas": Implementation(name="pallas", platforms=frozenset({"tpu"}), passes=frozenset({"decode"}), kernel=True,
                             shapes=_tpu_pages, about="JAX's TPU kernel ragged_paged_attention, pages read in place"),
    "gpu": Implementation(name="gpu", platforms=frozenset({"gpu"}), passes=frozenset({"decode"}), window=False,
                          kernel=True, shapes=_gpu_pages,
                          about="JAX's Pallas GPU kernel paged_attention, pages read in place"),
}
"""`sampling.paged_attention`'s implementations."""

FAMILIES = {"model.attention": MODEL, "sampling.paged_attention": DECODE}


def auto_order(need: Need) -> tuple[str, ...]:
    """`auto`'s candidates for `need`, fastest first."""
    if need.name == "decode":
        # The GPU paged kernel ("gpu") has run interpreted on CPU only, never compiled by Triton on a
        # GPU: until a device run shows it works, auto keeps the gather path there and the kernel
        # is `sampling.paged_attention: gpu`, asked for by name.
        return {"tpu": ("pallas", "gather"), "gpu": ("gather",), "cpu": ("gather",)}[need.platform]
    if need.platform == "cpu":
        return ("xla", "chunked") if need.keys <= AUTO_XLA_MAX_KEYS else ("chunked", "xla")
    return ({"tpu": "splash", "gpu": "gpu"}[need.platform], "chunked", "xla")


def pick(choice: str, need: Need) -> str:
    """The implementation that runs `need` for the setting `choice` ("auto" or a name of the pass's
    family): auto -> the fastest that supports it; a name that cannot run it -> ValueError in one
    line naming the setting, why, and a choice that works."""
    key = "sampling.paged_attention" if need.name == "decode" else "model.attention"
    table = FAMILIES[key]
    if choice == "auto":
        return next(n for n in auto_order(need) if table[n].refuses(need) is None)
    if choice not in table:
        raise ValueError(f"{key}={choice!r} is not one of {['auto', *table]}")
    why = table[choice].refuses(need)
    if why is not None:
        works = pick("auto", need)
        raise ValueError(f"{key}={choice} {why}, which this run needs for {PASS_WORDS[need.name]}; use "
                         f"{key}={works} (or auto)")
    return choice


def supports_parents(choice: str, need: Need) -> bool:
    """Whether the implementation `choice` picks for a plain pass `need` also sees parent segments:
    packing then lays a group's completions after one copy of their prompt (else a prompt copy
    before each completion, so the pass compares segment ids by equality only)."""
    return "packed" in MODEL[pick(choice, dataclasses.replace(need, name="plain"))].passes


def run_needs(config, cfg, platform: str) -> list[Need]:
    """The model passes a run's `config` (a RunConfig) asks of `model.attention` for a model with
    config `cfg` on `platform`: the prefill (plain), the training and reference passes (plain,
    shared-prompt or packed, by train.shared_prompt and train.packing), and the paged engine's
    decode step (`sampling.paged_attention`)."""
    from grpo_jax.config.rollout import ENGINE_TRAITS

    t, s = config.train, config.sampling
    keys = max(s.prompt_buckets) + s.max_new_tokens
    plain = model_need("plain", cfg, platform, keys=keys)
    needs = [plain]
    if t.packing:
        if supports_parents(config.model.attention, plain) and t.shared_prompt:
            needs.append(dataclasses.replace(plain, name="packed"))
    elif t.shared_prompt:
        needs.append(dataclasses.replace(plain, name="shared_prompt"))
    if ENGINE_TRAITS[s.engine][1]:  # a page pool: the decode step's attention is chosen
        import jax.numpy as jnp

        needs.append(dataclasses.replace(plain, name="decode", page_size=s.page_size,
                                         dtype_bytes=jnp.dtype(config.model.dtype).itemsize))
    return needs


def check_run(config, cfg, platform: str) -> list[str]:
    """Every pass of the run picked (ValueError, one line, for an explicit choice that cannot run
    one); returns "pass: implementation" for each."""
    picks = []
    for need in run_needs(config, cfg, platform):
        choice = config.sampling.paged_attention if need.name == "decode" else config.model.attention
        picks.append(f"{need.name}: {pick(choice, need)}")
    return picks
