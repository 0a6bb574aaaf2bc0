"""The configuration of `grpo-jax train-rm`: a reward model trained on preference pairs with the
Bradley-Terry loss (sections `model:`, `data:`, `train:`, `checkpoint:`, `mesh:`;
`loading.load_rm_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from grpo_jax.config.checks import choice_in, positive
from grpo_jax.config.model import ModelConfig
from grpo_jax.config.training import LR_SCHEDULES, CheckpointConfig, LRSchedule, MeshConfig, OptimizerConfig

PairChatTemplate = Literal["auto", "never"]
PAIR_CHAT_TEMPLATES: tuple[str, ...] = get_args(PairChatTemplate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceDataConfig:
    """Preference pairs: a TFDS builder of this project (`name`, e.g. `arithmetic_preferences`) or
    jsonl files (`train_file`, `eval_file`: one JSON object per line). A row's prompt is `template`
    formatted with its fields (the user message: the reward model's chat template wraps it when it
    has one, `chat_template: auto`), its answers the `chosen_field` and `rejected_field` texts; a
    `margin_field` (optional) gives each pair's margin for the loss."""

    name: str | None = "arithmetic_preferences"
    builder_config: str | None = None
    builder_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_dir: str = "data/tfds"
    train_split: str = "train"
    eval_split: str = "test"
    train_file: str | None = None
    eval_file: str | None = None
    template: str = "{question}"
    system_prompt: str | None = None
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    margin_field: str | None = None
    chat_template: PairChatTemplate = "auto"
    max_length: int = 128  # tokens of prompt + answer; longer pairs keep their last tokens (counted)
    eval_pairs: int = 512  # held-out pairs scored at each evaluation (0 = all)

    def __post_init__(self):
        if (self.name is None) == (self.train_file is None):
            raise ValueError("data: set exactly one of data.name (a TFDS preference builder) and data.train_file "
                             "(jsonl pairs)")
        if (self.train_file is None) != (self.eval_file is None):
            raise ValueError("data: jsonl pairs need both data.train_file and data.eval_file (the held-out pairs)")
        choice_in("data", "chat_template", self.chat_template, PAIR_CHAT_TEMPLATES)
        positive("data", "max_length", self.max_length)
        if self.eval_pairs < 0:
            raise ValueError(f"data.eval_pairs must be >= 0, got {self.eval_pairs}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMTrainConfig:
    """AdamW on -log sigmoid(r_chosen - r_rejected - margin) over `batch_size` pairs a step, plus
    `lm_coef` times the backbone's next-token cross-entropy on the chosen answers' tokens (0 = off;
    the backbone predicts through its tied embedding, so nothing is added to the saved model);
    held-out pair accuracy every `eval_every` steps (0: before the first and after the last)."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    lr_schedule: LRSchedule = "constant"  # or "cosine": warm-up, then decay to 0 at the last step
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    margin: float = 0.0  # a constant margin, added to the margin_field's when both are set
    lm_coef: float = 0.0
    seed: int = 0
    eval_every: int = 0
    progress: bool = True
    max_consecutive_skips: int = 5  # abort after this many non-finite updates in a row (each is skipped)
    resume: bool = False  # continue from the output directory's newest checkpoint (else one there is refused)

    def __post_init__(self):
        for name in ("steps", "batch_size", "learning_rate", "max_grad_norm", "max_consecutive_skips"):
            positive("train", name, getattr(self, name))
        choice_in("train", "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for name in ("warmup_steps", "weight_decay", "margin", "lm_coef", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        self.optimizer  # noqa: B018  (its checks: a cosine schedule needs steps past its warm-up)

    @property
    def optimizer(self) -> OptimizerConfig:
        """The reward model's optimizer: this section's learning rate, schedule over `steps`,
        clipping and weight decay, with Adam's default betas and eps."""
        return OptimizerConfig(learning_rate=self.learning_rate, lr_schedule=self.lr_schedule,
                               warmup_steps=self.warmup_steps, total_steps=self.steps,
                               max_grad_norm=self.max_grad_norm, weight_decay=self.weight_decay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMRunConfig:
    """A reward-model training run. model: an HF `*ForSequenceClassification` directory (to train
    further), an HF causal LM directory (its decoder, with a new score head), or a random
    `architecture` with a tokenizer."""

    model: ModelConfig | None = None
    data: PreferenceDataConfig = dataclasses.field(default_factory=PreferenceDataConfig)
    train: RMTrainConfig = dataclasses.field(default_factory=RMTrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)  # as the RL trainer's
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        if self.model is None:
            raise ValueError("model: a reward model needs model.path or model.architecture (+ model.tokenizer)")
