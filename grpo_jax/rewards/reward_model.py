"""`reward_model`: scores from a learned reward model (an HF `*ForSequenceClassification` directory).

    rewards:
      - name: reward_model
        kwargs: {path: DIR, batch_size: 32, normalize: true}
        weight: 1.0

The model (`models.reward_model`) is loaded into host memory once, when the config is read (a bad
path fails before training), and cut onto the run's mesh by the policy's sharding rules (`place`;
no chip holds it whole); each call scores prompt + completion jitted on device, `batch_size` rows
at a time, in a few padded lengths so that few shapes compile. Its input is built with the reward model's own tokenizer (`rm_input`): with a
chat template, [the prompt's messages, the completion as the assistant's turn]; else the prompt's
text followed by the completion. The prompt's messages are the user (and system) messages before
the policy's chat template (the `prompt_messages` example field), so a reward model with another
template than the policy's never sees the policy's.

normalize: scores become (score - mean) / std over every score this reward has produced so far
(running, this batch included; `state` / `load_state_dict` carry the statistics across a resume), so
the reward model's scale does not set the weight it gets beside verifiable rewards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.runtime.sharding import pow2_bucket, round_to_row_shards

CHAT_TEMPLATE_CHOICES = ("auto", "never")


def rm_input(tokenizer, prompt: str, completion: str, messages: Sequence[Mapping[str, str]] | None = None, *,
             use_chat: bool) -> str:
    """The text a reward model scores for (prompt, completion): with its chat template
    [messages..., assistant: completion]; without one, the messages' contents (or the prompt text)
    followed by the completion."""
    if use_chat:
        turns = list(messages) if messages else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": completion}], tokenize=False)
    text = "\n\n".join(m["content"] for m in messages) if messages else prompt
    return text + completion


def place_on(model, mesh):
    """Place a scoring model (a reward model, a judge; loaded into host memory, `on_host`) on the
    run's `mesh` by the policy's sharding rules, and return the mesh it is on: each device receives
    only its own slices, cut on the host, so no chip ever holds the whole model. With several
    processes each host scores its own rows, so the model goes on a mesh of this host's devices."""
    from grpo_jax.config import MeshConfig
    from grpo_jax.runtime.sharding import make_mesh, place_model

    if jax.process_count() > 1:
        mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), jax.local_devices())
    place_model(model, mesh)
    return mesh


def on_default_device(model) -> None:
    """A scoring model used without a mesh: its host (NumPy) parameters moved to the default
    device once, in place, so that each call does not copy them again."""
    params = nnx.state(model, nnx.Param)
    if any(isinstance(x, np.ndarray) for x in jax.tree.leaves(params)):
        nnx.update(model, jax.tree.map(jnp.asarray, params))


class RunningMoments:
    """Mean and variance of every value seen so far (Chan et al.'s parallel update)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64)
        if values.size == 0:
            return
        n, mean = values.size, float(values.mean())
        m2 = float(((values - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0


class RewardModelReward:
    """The `reward_model` reward (see the module docstring). path: the classifier's HF directory
    (with its tokenizer); label: which output column is the score (0 for the usual 1-label
    reward model); max_length: longer inputs keep their last tokens (the score is read at the end)."""

    def __init__(self, *, path: str, batch_size: int = 32, normalize: bool = False, max_length: int = 512,
                 label: int = 0, chat_template: str = "auto", dtype: str = "float32"):
        from grpo_jax.models.hf import load_tokenizer
        from grpo_jax.models.reward_model import load_reward_model

        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got {batch_size} and {max_length}")
        if chat_template not in CHAT_TEMPLATE_CHOICES:
            raise ValueError(f"chat_template must be one of {list(CHAT_TEMPLATE_CHOICES)}, got {chat_template!r}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        # Kept in host memory until `place` cuts it onto the run's mesh (or a mesh-less call moves it).
        self.model = load_reward_model(path, dtype=jnp.dtype(dtype), on_host=True)
        if not 0 <= label < self.model.num_labels:
            raise ValueError(f"label={label}, but {path} has {self.model.num_labels} output(s)")
        self.tokenizer = load_tokenizer(path)
        self.use_chat = chat_template == "auto" and bool(getattr(self.tokenizer, "chat_template", None))
        self.path, self.batch_size, self.max_length, self.label = str(path), int(batch_size), int(max_length), label
        self.normalize = bool(normalize)
        self.moments = RunningMoments()
        self.truncated = 0  # inputs cut to their last max_length tokens, over the run
        self.mesh = None
        self._jitted = None

    # ------------------------------------------------------------------ placement
    def place(self, mesh) -> None:
        """Shard the reward model on `mesh` by the policy's rules (`place_on`)."""
        self.mesh, self._jitted = place_on(self.model, mesh), None

    def _score_fn(self):
        if self._jitted is None:
            if self.mesh is None:
                on_default_device(self.model)
            graphdef, state = nnx.split(self.model)
            label = self.label

            def score(state, ids, mask):
                return nnx.merge(graphdef, state)(ids, mask)[:, label]

            if self.mesh is None:
                self._jitted = (jax.jit(score), state, None)
            else:
                from grpo_jax.runtime.sharding import batch_sharding, replicated, tree_shardings

                fn = jax.jit(score, in_shardings=(tree_shardings(state), batch_sharding(self.mesh, 2),
                                                  batch_sharding(self.mesh, 2)), out_shardings=replicated(self.mesh))
                self._jitted = (fn, state, self.mesh)
        return self._jitted

    # ------------------------------------------------------------------ scoring
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; longer than max_length: its last tokens, counted in `truncated`."""
        ids = self.tokenizer(list(texts), add_special_tokens=not self.use_chat)["input_ids"]
        self.truncated += sum(len(row) > self.max_length for row in ids)
        return [list(row[-self.max_length:]) for row in ids]

    def raw_scores(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [n]: the reward model's score of each text (no normalisation)."""
        fn, state, mesh = self._score_fn()
        rows = self.encode(texts)
        pad = self.model.pad_token_id
        B = round_to_row_shards(self.batch_size, mesh)
        out = np.zeros(len(rows), np.float32)
        for start in range(0, len(rows), B):
            chunk = rows[start:start + B]
            # Right-padded to a power-of-two length: few distinct shapes compile.
            T = min(self.max_length, pow2_bucket(max(len(r) for r in chunk), 8))
            ids = np.full((B, T), pad, np.int32)
            mask = np.zeros((B, T), np.int32)
            for i, r in enumerate(chunk):
                ids[i, :len(r)], mask[i, :len(r)] = r, 1
            out[start:start + len(chunk)] = np.asarray(fn(state, ids, mask))[:len(chunk)]
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], prompt_messages=None,
                 **_fields: Any) -> list[float]:
        return self._score(prompts, completions, prompt_messages, update=True)

    def without_updates(self):
        """This reward without learning its normalisation from what it scores (evaluation)."""
        return lambda prompts, completions, prompt_messages=None, **_: self._score(
            prompts, completions, prompt_messages, update=False)

    def _score(self, prompts, completions, prompt_messages, *, update: bool) -> list[float]:
        messages = prompt_messages if prompt_messages is not None else [None] * len(prompts)
        texts = [rm_input(self.tokenizer, p, c, m, use_chat=self.use_chat)
                 for p, c, m in zip(prompts, completions, messages)]
        scores = self.raw_scores(texts)
        if self.normalize:
            if update:
                self.moments.update(scores)
            scores = (scores - self.moments.mean) / max(self.moments.std, 1e-6)
        return [float(s) for s in scores]

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        m = self.moments
        return {"count": m.count, "mean": m.mean, "m2": m.m2}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.moments.count, self.moments.mean, self.moments.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
