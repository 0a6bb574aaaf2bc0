"""The rollout's sections: `data:` (prompts), `rewards:` (the functions that score completions),
`sampling:` (how completions are drawn) and `eval:` (held-out evaluation), with their choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from grpo_jax.config.checks import choice_in, non_negative, positive

ChatTemplate = Literal["auto", "always", "never"]
Overlong = Literal["skip", "truncate"]
Engine = Literal["static", "continuous", "paged"]
PagedAttention = Literal["auto", "gather", "pallas", "gpu"]
PAGED_ATTENTION: tuple[str, ...] = get_args(PagedAttention)
ENGINES: tuple[str, ...] = get_args(Engine)
# What each engine is, the one table of it (grpo_jax.engine.engines builds its engines from it):
# (decodes `sampling.slots` rows at once, refilled as rows finish; its cache is a page pool).
ENGINE_TRAITS: dict[str, tuple[bool, bool]] = {"static": (False, False), "continuous": (True, False),
                                               "paged": (True, True)}
CHAT_TEMPLATES: tuple[str, ...] = get_args(ChatTemplate)
OVERLONG: tuple[str, ...] = get_args(Overlong)

@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the sampler draws G completions per prompt (grpo_jax.engine.sampling.generate)."""

    group_size: int = 8
    max_new_tokens: int = 256
    min_new_tokens: int = 0  # stop tokens cannot be drawn before this many (0 = off)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    # The id written after a completion's stop token and left of a padded prompt. A run sets it from
    # the tokenizer (its pad token, else the first stop token) unless the config gives one.
    pad_token_id: int | None = None
    # Generated slots are split into this many chunks; phase i attends the prompt and chunks 1..i,
    # not the whole cache. Each phase compiles one more decode step (4 -> 8 was slower on CPU).
    attend_phases: int = 4
    # paged (the default): `slots` decode slots (0 = one per row), each refilled with the next waiting
    # sequence as soon as its own stops, over a pool of cache pages (grpo_jax.engine.paged): a
    # sequence holds pages for the tokens it has, not for max_new_tokens, so the same cache bytes run
    # more sequences at once; kv_cache_bytes 0 (gather path): one max-length reservation per slot, read in place;
    # with a slot and max-length cache for every row (slots 0, kv_cache_bytes 0) it runs the lock-step
    # loop. continuous: the paged engine with one max-length reservation per slot whatever
    # kv_cache_bytes says (the per-slot engine of earlier releases). static: every row of a call decodes in lock-step until the
    # longest is done, one uniform per step for all rows (how runs before round 4 sampled).
    engine: Engine = "paged"
    slots: int = 0
    # The paged engine's cache per row shard (data x fsdp x expert), in bytes: every page, the prompts' and the
    # sequences'. Bytes, not pages, so two models or page sizes compare at equal memory. auto: sized
    # at a run's start from the chip's memory, kv_cache_fraction of what the run does not hold
    # (grpo_jax.engine.sizing), with slots 0 then as many as the pool keeps busy; on CPU auto is 0.
    # 0: one max-length reservation per slot, read in place (the per-slot engine's).
    kv_cache_bytes: int | Literal["auto"] = "auto"
    kv_cache_fraction: float = 0.9  # of what is left of a chip (vLLM's gpu_memory_utilization)
    page_size: int = 16  # tokens per page (the TPU kernel prefers 64-256)
    # gather: pure-JAX attention over each sequence's pages (any backend); pallas: JAX's TPU kernel
    # ragged_paged_attention (head_dim % 128 == 0); gpu: JAX's Pallas GPU paged kernel, pages read in
    # place (no sliding window; asked for by name until it has run on a GPU); auto: pallas on TPU
    # where it applies, else gather
    # (grpo_jax.models.dispatch.DECODE says what each can run).
    paged_attention: PagedAttention = "auto"
    # With dynamic sampling, the paged engine returns to the host every this many decode steps
    # to score the groups that finished (grpo_jax.rollout.stream).
    segment_steps: int = 16

    @property
    def kv_bytes(self) -> int:
        """`kv_cache_bytes` as the engine reads it: an unresolved `auto` (an engine called outside a
        run, or on CPU) is 0."""
        return 0 if self.kv_cache_bytes == "auto" else self.kv_cache_bytes

    def __post_init__(self):
        choice_in("sampling", "engine", self.engine, ENGINES)
        positive("sampling", "segment_steps", self.segment_steps)
        positive("sampling", "page_size", self.page_size)
        if self.kv_cache_bytes != "auto":
            non_negative("sampling", "kv_cache_bytes", self.kv_cache_bytes)
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"sampling.kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        choice_in("sampling", "paged_attention", self.paged_attention, PAGED_ATTENTION)
        if self.slots < 0:
            raise ValueError(f"sampling.slots must be >= 0 (0 = one per sequence), got {self.slots}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_buckets", tuple(sorted(int(b) for b in self.prompt_buckets)))
        if self.group_size < 1:
            raise ValueError(f"sampling.group_size must be >= 1, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.attend_phases < 1:
            raise ValueError(f"sampling.attend_phases must be >= 1, got {self.attend_phases}")
        if not self.prompt_buckets or self.prompt_buckets[0] < 1:
            raise ValueError(f"sampling.prompt_buckets must be positive lengths, got {self.prompt_buckets}")
        if self.pad_token_id is not None and self.pad_token_id < 0:
            raise ValueError(f"sampling.pad_token_id must be >= 0, got {self.pad_token_id}")

    @property
    def pad_id(self) -> int:
        """The pad id to write (0 when none was set or resolved from a tokenizer)."""
        return 0 if self.pad_token_id is None else self.pad_token_id


# The settings of a built-in dataset, which a `data.path` replaces (configs/demo_cpu.yaml's arithmetic builder
# with `--set data.path=rows.jsonl` trains on the rows, not on arithmetic).
BUILTIN_DATASET_KEYS = ("name", "builder_config", "builder_kwargs", "manual_dir")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts: a TFDS dataset (project builders `arithmetic`, `countdown`, `word_problems`, or `gsm8k`)
    by `name`, or your own rows by `path` (grpo_jax.data.files: JSONL, JSON, CSV, Parquet, a
    `datasets` save_to_disk directory, a TFDS directory), and how rows become prompt tokens (the
    tokenizer's chat template when it has one, else `template`; or a chat in `messages_field`)."""

    name: str = "arithmetic"
    path: str | None = None  # your own data; replaces `name` and the builder settings
    eval_path: str | None = None  # held-out rows from another file (else the dataset's eval_split,
    eval_fraction: float | None = None  # else this fraction of the rows, 0.1 when not set,
    split_seed: int = 0  # drawn with this seed)
    answer_field: str | None = "answer"  # the reference answer rewards receive as `answer`; null: none
    messages_field: str | None = None  # a field holding the prompt as a chat: [{role, content}, ...]
    builder_config: str | None = None  # TFDS builder config name
    # Synthetic builders: overrides of the config's fields (num_train, seed, digits, ops, formats, ...);
    # each distinct set is built into its own directory.
    builder_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_dir: str = "data/tfds"  # prepared TFDS data; `path`'s Arrow cache goes in data_dir/files
    manual_dir: str | None = None  # gsm8k offline: the directory holding its jsonl files
    train_split: str = "train"
    eval_split: str = "test"
    template: str = "{question}"
    system_prompt: str | None = None
    chat_template: ChatTemplate = "auto"
    max_prompt_tokens: int = 256
    overlong: Overlong = "skip"
    prompts_per_step: int = 8
    # The built-in dataset settings a `path` replaced ("data.name='gsm8k'", ...): the run says so in one line.
    replaced: tuple[str, ...] = dataclasses.field(default=(), init=False, compare=False)

    def __post_init__(self):
        choice_in("data", "chat_template", self.chat_template, CHAT_TEMPLATES)
        choice_in("data", "overlong", self.overlong, OVERLONG)
        positive("data", "max_prompt_tokens", self.max_prompt_tokens)
        positive("data", "prompts_per_step", self.prompts_per_step)
        if self.path is not None:  # your own rows: a built-in dataset's settings (a shipped config's) go
            replaced = []
            for name in BUILTIN_DATASET_KEYS:
                default = _DATA_DEFAULTS[name]
                if (dict(getattr(self, name)) if name == "builder_kwargs" else getattr(self, name)) != default:
                    replaced.append(f"data.{name}={_shown(getattr(self, name))}")
                    object.__setattr__(self, name, default)  # still constructing: the config stays frozen after
            if replaced and not replaced[0].startswith("data.name="):
                replaced.insert(0, f"data.name={self.name!r}")  # the default's name was the config's dataset too
            object.__setattr__(self, "replaced", tuple(replaced))
        elif self.eval_path is not None or self.eval_fraction is not None:
            raise ValueError("data.eval_path and data.eval_fraction are for data.path's rows; a built-in "
                             "dataset's held-out rows are its data.eval_split")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.messages_field is not None and self.template != "{question}":
            raise ValueError(f"data.messages_field {self.messages_field!r} takes the prompt from a chat; "
                             f"data.template {self.template!r} would format another: set one of them")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One reward function by its registered name (`grpo_jax.rewards.REWARD_FUNCTIONS`), its weight,
    and keyword arguments bound to it. Your own function (`module:function`) runs in worker
    processes, each call within `timeout_s` (past it the call's samples are dropped and counted)."""

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float = 120.0

    def __post_init__(self):
        positive("rewards", "timeout_s", self.timeout_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """Multi-turn episodes (grpo_jax.env): the environment by `name` (a built-in:
    calculator, countdown, python; or module:Class, path/to/file.py:Class) made with `kwargs` once
    per episode. `max_turns` model turns, `max_env_tokens` environment tokens after one turn,
    `timeout_s` per environment call; sampling.max_new_tokens counts the model's tokens over all
    turns. Hitting a limit ends the episode as truncated; an environment that raises or times out
    drops its episode (`env/failed`). Your own environment (module:Class) runs in up to `workers`
    worker processes, where a call that hangs is ended with its process (0: in the trainer's
    process, on its bounded threads, where it cannot be)."""

    name: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 4
    max_env_tokens: int = 256
    timeout_s: float = 30.0
    workers: int = 4

    def __post_init__(self):
        if not self.name:
            raise ValueError("environment.name must name an environment (calculator, countdown, python, "
                             "module:Class or path/to/file.py:Class)")
        positive("environment", "max_turns", self.max_turns)
        positive("environment", "max_env_tokens", self.max_env_tokens)
        positive("environment", "timeout_s", self.timeout_s)
        non_negative("environment", "workers", self.workers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Where and with which parameters rollouts are sampled (grpo_jax.rollout.pipeline).

    staleness k: the batch the update of step t learns from was sampled with the parameters after
    step t - 1 - k (k = 0: the synchronous loop, with the parameters the update starts from). The
    first k + 1 steps learn from batches sampled with the starting parameters (their staleness
    is t - 1). While the learner updates on step t's batch, the batch of step t + k is sampled.
    sampler_devices N: the sampler runs on N devices, N / hosts of each host (its own mesh,
    data-parallel, the weights replicated), and the learner on the others, the learner's parameters copied device to
    device after each update (perf/weight_sync_s); 0 = both on the run's mesh."""

    staleness: int = 0
    sampler_devices: int = 0

    def __post_init__(self):
        non_negative("rollout", "staleness", self.staleness)
        non_negative("rollout", "sampler_devices", self.sampler_devices)

    @property
    def pipelined(self) -> bool:
        return self.staleness > 0 or self.sampler_devices > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation every `every` steps (0 = only before the first and after the last step):
    `k` samples for each of `num_prompts` prompts; accuracy = mean correctness of all samples,
    pass@k = share of prompts with at least one correct sample. Correct = `reward` function > 0.5
    (default: the first configured reward)."""

    every: int = 0
    num_prompts: int = 64
    k: int = 4
    temperature: float | None = None  # None = sampling.temperature
    reward: str | None = None
    # A second, independent judge of the same held-out samples (a registered reward name or
    # module:function, with `verifier_kwargs`), e.g. math_accuracy with {verifier: math_verify}
    # beside a regex-checked training reward: eval/verifier_accuracy and
    # health/verifier_disagreement (the share of judged samples the two judges disagree on).
    verifier: str | None = None
    verifier_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # What RL costs the policy elsewhere (grpo_jax.rollout.retention): at every evaluation, the
    # policy's NLL on a general corpus (retention/general_nll) and KL(pi_0 || pi) there
    # (retention/kl, pi_0 kept as its `retention_top_k` most likely tokens per position).
    # `retention_corpus`: a JSONL file of {"text"} or {"prompt", "response"} rows (default: the
    # shipped grpo_jax/data/general_corpus.jsonl); each row's scored tokens cut to `retention_max_tokens`.
    retention: bool = False
    retention_top_k: int = 64
    retention_corpus: str | None = None
    retention_max_tokens: int = 128

    def __post_init__(self):
        if self.verifier_kwargs and self.verifier is None:
            raise ValueError("eval.verifier_kwargs is set but eval.verifier is not")
        if self.retention_corpus is not None and not self.retention:
            raise ValueError("eval.retention_corpus is set but eval.retention is false; set eval.retention: true")
        positive("eval", "retention_top_k", self.retention_top_k)
        positive("eval", "retention_max_tokens", self.retention_max_tokens)
        non_negative("eval", "every", self.every)
        positive("eval", "num_prompts", self.num_prompts)
        positive("eval", "k", self.k)
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")


_DATA_DEFAULTS = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
                  for f in dataclasses.fields(DataConfig) if f.name in BUILTIN_DATASET_KEYS}


def _shown(value: Any) -> str:
    return repr(dict(value)) if isinstance(value, Mapping) else repr(value)
