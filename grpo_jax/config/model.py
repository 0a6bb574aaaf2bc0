"""The policy's sections: `model:` (where the weights come from, the dtypes) and `lora:` (low-rank
adapters), with the choices each may take."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from grpo_jax.config.checks import choice_in, positive

DType = Literal["float32", "bfloat16"]
Remat = Literal["none", "block", "dots", "attention", "offload"]
Attention = Literal["auto", "xla", "chunked", "splash", "gpu"]
LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES: tuple[str, ...] = get_args(DType)
REMATS: tuple[str, ...] = get_args(Remat)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
LORA_TARGETS: tuple[str, ...] = get_args(LoRATarget)
RoutingReplay = Literal["sampler", "none"]
ROUTING_REPLAYS: tuple[str, ...] = get_args(RoutingReplay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts policy (`moe:`; a dense model ignores it).

    routing_replay: `sampler` routes every learner pass (the update and the KL reference's
    log-probs) by the experts the sampler chose for each token (the router's weights at those
    experts stay differentiable); `none` lets the learner's router choose again, so the sampler and
    the learner may score one token through different experts (`moe/routing_mismatch` says how
    often). aux_loss_coef: the load-balancing loss's weight in the update; None takes the model's
    own (`router_aux_loss_coef` of its config.json)."""

    routing_replay: RoutingReplay = "sampler"
    aux_loss_coef: float | None = None

    def __post_init__(self):
        choice_in("moe", "routing_replay", self.routing_replay, ROUTING_REPLAYS)
        if self.aux_loss_coef is not None and self.aux_loss_coef < 0:
            raise ValueError(f"moe.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Where the policy comes from: an HF-format directory or a `.gguf` file (`path`), or a random initialisation of
    `architecture` (TransformerConfig fields; vocab_size defaults to the tokenizer's) for demos.

    tokenizer: a directory with tokenizer files (default: `path`), or "char" for the built-in
    character-level tokenizer. chat_template: a Jinja chat template (the text, or a path to a
    `.jinja` file) that replaces the tokenizer's own, or gives one to a tokenizer without it (the
    char tokenizer, for multi-turn demos); it is saved with exported models.
    """

    path: str | None = None
    architecture: Mapping[str, Any] | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: DType = "float32"  # compute dtype
    param_dtype: DType = "float32"  # master weights
    # true: the training and reference passes and the prefill run the layers in one lax.scan
    # (compile time independent of depth); false: unrolled (compile time grows with depth; the GRPO
    # update was 5-14% faster on CPU for the 4-layer benchmark model, benchmarks/RESULTS.md).
    scan_layers: bool = True
    # What the training pass keeps for the backward pass of each decoder layer (the sampler and the
    # reference pass take no gradient, so it changes nothing there). none: everything, fastest, the
    # most memory (attention's T x T probabilities of every layer among it); block: only each layer's
    # input, the layer recomputed in the backward pass (~1/3 more compute, activations of one layer);
    # dots: the weight matmuls' outputs, recomputing attention, norms and activations in between;
    # attention: q, k, v and attention's output, recomputing norms, projections' inputs and the MLP
    # (attention, the part that grows with the length, never runs twice); offload: as block, with
    # each layer's saved input in the host's pinned memory instead of HBM (16k-token rows: the 28
    # saved inputs of Qwen3-0.6B were 7 GiB of a v5e's 16).
    # `grpo-jax bench memory` shows what each costs a run on its chips before it launches.
    remat: Remat = "none"
    # The attention implementation of the training, reference and prefill passes (decoding reads
    # its cache its own way). xla: plain XLA, scores [B, H, T, T] (short sequences, tests); chunked:
    # flash-style online softmax in pure JAX, O(T x block) memory, any backend; splash: JAX's Pallas
    # TPU kernel (splash attention, under shard_map); gpu: JAX's Pallas GPU kernel (no sliding
    # window or soft-capping, plain passes only); auto: for each pass the fastest implementation
    # that supports it (grpo_jax.models.dispatch): splash on TPU, gpu on GPU where the pass and
    # model allow (chunked else), on CPU xla up to 256 key slots and chunked above. An explicit
    # choice that cannot run some pass of the run is refused at start and by `grpo-jax check`.
    attention: Attention = "auto"

    def __post_init__(self):
        if (self.path is None) == (self.architecture is None):
            raise ValueError("model: set exactly one of model.path (an HF model directory) and "
                             "model.architecture (a random initialisation)")
        if self.path is None and self.tokenizer is None:
            raise ValueError("model.architecture needs model.tokenizer (a tokenizer directory or \"char\")")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {list(DTYPES)}")
        choice_in("model", "remat", self.remat, REMATS)
        choice_in("model", "attention", self.attention, ATTENTIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the policy (`rank` 0 = off: full fine-tuning). With adapters only they
    train (optimizer state for them alone) and the base weights stay frozen; the KL reference
    (grpo.beta > 0) is the same model with the adapters switched off, so no second copy of the
    weights is held. The update is x W + (alpha / rank) (dropout(x) A) B on each of `targets`;
    `dropout` (PEFT's lora_dropout) acts in the training pass only, never in sampling or in the
    reference and old-policy passes."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = off), got {self.rank}")
        positive("lora", "alpha", self.alpha)
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets {list(self.targets)}: choose from {list(LORA_TARGETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

