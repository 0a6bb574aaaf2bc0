"""Bad checkpoints fail early with errors that name the problem; nothing is silently random."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from hf_models import build_hf_model
from safetensors.numpy import load_file, save_file

from grpo_jax.models import Transformer, UnsupportedModelError, from_pretrained, save_pretrained
from grpo_jax.models.presets import tiny


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    build_hf_model("qwen3").save_pretrained(path)
    return path


def _copy(src, dst, *, tensors=None, config=None):
    """A copy of checkpoint `src` with its tensors and/or config.json replaced."""
    dst.mkdir()
    weights = load_file(str(src / "model.safetensors"))
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        cfg = config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_model_type_names_the_supported_ones(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "m", config=lambda c: {**c, "model_type": "mistral"})
    with pytest.raises(UnsupportedModelError) as e:
        from_pretrained(bad)
    msg = str(e.value)
    assert "'mistral'" in msg
    for family in ("llama", "qwen2", "qwen3", "gemma3_text"):
        assert family in msg


def test_unsupported_rope_type_is_refused(good_dir, tmp_path):
    def yarn(c):
        c = dict(c)
        c["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
        return c

    with pytest.raises(UnsupportedModelError, match="yarn.*default, linear, llama3"):
        from_pretrained(_copy(good_dir, tmp_path / "m", config=yarn))


def test_missing_tensor_is_named(good_dir, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    bad = _copy(good_dir, tmp_path / "m", tensors=lambda w: {k: v for k, v in w.items() if k != name})
    with pytest.raises(ValueError, match=f"missing tensor '{name}'.*\\(32,\\)"):
        from_pretrained(bad)


def test_misshaped_tensor_names_both_shapes(good_dir, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(w):
        w = dict(w)
        w[name] = w[name][:50]
        return w

    with pytest.raises(ValueError) as e:
        from_pretrained(_copy(good_dir, tmp_path / "m", tensors=shrink))
    assert name in str(e.value) and "(50, 64)" in str(e.value) and "(96, 64)" in str(e.value)


def test_config_that_does_not_match_weights_fails_on_the_first_tensor(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "m", config=lambda c: {**c, "intermediate_size": 128})
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight.*\(96, 64\).*\(128, 64\)"):
        from_pretrained(bad)


def test_unused_tensors_are_an_error_not_ignored(good_dir, tmp_path):
    extra = _copy(good_dir, tmp_path / "m", tensors=lambda w: {**w, "model.layers.0.mystery.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="does not use.*mystery"):
        from_pretrained(extra)
    # Two layers in config.json but three in the weights: the extra layer is not silently dropped.
    fewer = _copy(good_dir, tmp_path / "f", config=lambda c: {**c, "num_hidden_layers": 1,
                                                               "layer_types": c["layer_types"][:1]})
    with pytest.raises(ValueError, match="does not use.*layers.1"):
        from_pretrained(fewer)


def test_missing_paths_and_files(good_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        from_pretrained(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "empty")
    only_cfg = tmp_path / "only_cfg"
    only_cfg.mkdir()
    (only_cfg / "config.json").write_text((good_dir / "config.json").read_text())
    (only_cfg / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*pytorch_model.bin"):
        from_pretrained(only_cfg)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    model = build_hf_model("qwen2")  # tied
    model.save_pretrained(tmp_path / "ok")

    def add_head(w):
        w = dict(w)
        w["lm_head.weight"] = w["model.embed_tokens.weight"] + 1.0
        return w

    with pytest.raises(ValueError, match="ties word embeddings but lm_head.weight differs"):
        from_pretrained(_copy(tmp_path / "ok", tmp_path / "bad", tensors=add_head))


def test_save_pretrained_replaces_stale_shards(good_dir, tmp_path):
    model = from_pretrained(good_dir)
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    from_pretrained(tmp_path)


def test_tokenizer_saved_beside_the_model_loads_offline(good_dir, tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from grpo_jax.models import load_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "two": 4, "plus": 5, "is": 6, "four": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    save_pretrained(from_pretrained(good_dir), tmp_path / "m", tokenizer=fast)
    loaded = load_tokenizer(tmp_path / "m")
    assert loaded("two plus two is four")["input_ids"] == [4, 5, 4, 6, 7]
    assert loaded.eos_token_id == 2
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        load_tokenizer(good_dir)  # weights and config only


def test_decoding_past_the_cache_is_refused():
    """The cache is sized statically; a step beyond it fails instead of writing a clamped slot."""
    model = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    _, cache = model.prefill(np.ones((1, 3), np.int32), decode_steps=1)
    _, cache = model.decode_step(np.asarray([4], np.int32), cache)
    with pytest.raises(ValueError, match="decode step 1 is outside this cache's 1 decode slots"):
        model.decode_step(np.asarray([5], np.int32), cache)


def test_a_remote_model_directory_is_downloaded_once_and_loads_as_the_local_one(good_dir, tmp_path, monkeypatch):
    """gs:// paths go through fsspec; file:// is the same code path without a bucket."""
    import jax.numpy as jnp

    monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path / "cache"))
    remote = f"file://{good_dir}"
    ids = jnp.asarray([[1, 5, 9, 3]])
    np.testing.assert_array_equal(np.asarray(from_pretrained(path=remote)(ids)), np.asarray(from_pretrained(path=good_dir)(ids)))
    (copy,) = (tmp_path / "cache" / "remote").iterdir()
    weights = next(copy.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    from_pretrained(path=remote)
    assert weights.stat().st_mtime_ns == stamp  # not downloaded again
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(path=f"file://{tmp_path}/no_such_model")
