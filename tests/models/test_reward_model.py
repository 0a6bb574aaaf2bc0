"""Reward models against transformers' AutoModelForSequenceClassification (tiny random configs,
left and right padding), and our saved directories loaded back by transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hf_models import CASES, left_padded_batch, randomize_

from grpo_jax.models.reward_model import last_token_index, load_reward_model, save_reward_model

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"]


def build_hf_classifier(case: str, num_labels: int = 1, seed: int = 0):
    cls, kwargs = CASES[case]
    config = cls(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=num_labels)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    return randomize_(model.float().eval())


def right_padded(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out_ids, out_mask = np.zeros_like(ids), np.zeros_like(mask)
    for b in range(ids.shape[0]):
        real = ids[b][mask[b] == 1]
        out_ids[b, :len(real)] = real
        out_mask[b, :len(real)] = 1
    return out_ids, out_mask


def hf_scores(model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    return out.logits.float().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_transformers_with_left_and_right_padding(family, tmp_path):
    hf = build_hf_classifier(family, num_labels=2 if family == "qwen3" else 1)
    hf.save_pretrained(tmp_path / "rm")
    ours = load_reward_model(tmp_path / "rm")
    assert ours.num_labels == hf.config.num_labels
    left_ids, left_mask = left_padded_batch(96, [7, 3, 10, 5], seed=1)
    for ids, mask in ((left_ids, left_mask), right_padded(left_ids, left_mask)):
        want = hf_scores(hf, ids, mask)
        got = np.asarray(ours(ids, mask))
        assert np.abs(want).max() > 0.1  # the scores are not trivially zero
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    # One row alone scores what it scores in the padded batch.
    np.testing.assert_allclose(np.asarray(ours(left_ids[2:3], left_mask[2:3])),
                               hf_scores(hf, left_ids[2:3], left_mask[2:3]), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["llama", "mixtral", "gemma3_text"])
def test_a_saved_reward_model_loads_in_transformers_with_equal_scores(family, tmp_path):
    hf = build_hf_classifier(family, seed=3)
    hf.save_pretrained(tmp_path / "in")
    ours = load_reward_model(tmp_path / "in")
    save_reward_model(ours, tmp_path / "out")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").float().eval()
    assert type(back).__name__.endswith("ForSequenceClassification")
    ids, mask = left_padded_batch(96, [6, 9, 2], seed=4)
    np.testing.assert_allclose(hf_scores(back, ids, mask), np.asarray(ours(ids, mask)), atol=2e-4, rtol=2e-4)


def test_the_last_token_is_read_as_transformers_reads_it():
    pad = 0
    ids = np.array([[0, 0, 5, 6], [5, 6, 0, 0], [5, 0, 6, 0], [0, 0, 0, 0]], np.int32)
    np.testing.assert_array_equal(np.asarray(last_token_index(ids, pad)), [3, 1, 2, 0])


def test_bad_reward_model_directories_are_refused(tmp_path):
    causal = transformers.AutoModelForCausalLM.from_config(CASES["llama"][0](**CASES["llama"][1], pad_token_id=0))
    causal.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match="not a sequence-classification checkpoint"):
        load_reward_model(tmp_path / "causal")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_reward_model(tmp_path / "missing")
    hf = build_hf_classifier("llama")
    hf.config.pad_token_id = None
    hf.save_pretrained(tmp_path / "nopad")
    with pytest.raises(ValueError, match="no pad_token_id"):
        load_reward_model(tmp_path / "nopad")
