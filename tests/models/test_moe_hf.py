"""Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral): the layout transformers writes, the fused
layout it holds in memory, exact round trips, strict loading, and the configs we refuse. Logit
parity with transformers is test_models_parity's, whose CASES include both families."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_models import CASES, build_hf_model, left_padded_batch
from safetensors.numpy import load_file, save_file

from grpo_jax.config import ConfigError
from grpo_jax.models import Transformer, UnsupportedModelError, config_from_hf, config_to_hf, from_pretrained
from grpo_jax.models import save_pretrained
from grpo_jax.models.hf import read_values
from grpo_jax.models.hf_tensors import TensorReader
from grpo_jax.models.presets import tiny

MOE_CASES = ["qwen3_moe", "mixtral"]
# The expert projections' names inside `model.layers.{i}.` in the published layout.
BLOCKS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


@pytest.fixture(scope="module", params=MOE_CASES)
def saved(request, tmp_path_factory):
    """(case, transformers model, the directory its save_pretrained wrote)."""
    model = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def params_of(model) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    a, b = params_of(a), params_of(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def expert_names(family: str, num_layers: int, num_experts: int) -> set[str]:
    block, projections = BLOCKS[family]
    return {f"model.layers.{i}.{block}.gate.weight" for i in range(num_layers)} | {
        f"model.layers.{i}.{block}.experts.{j}.{p}.weight"
        for i in range(num_layers) for j in range(num_experts) for p in projections}


def test_transformers_routes_the_test_tokens_to_many_experts(saved):
    """The parity cases only check routing if different tokens pick different experts."""
    _, hf_model, _ = saved
    ids, mask = left_padded_batch(hf_model.config.vocab_size, [12, 7, 3])
    with torch.no_grad():
        out = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                       output_router_logits=True)
    real = mask.reshape(-1).astype(bool)
    for router_logits in out.router_logits:
        top = torch.topk(router_logits, hf_model.config.num_experts_per_tok, dim=-1).indices.numpy()[real]
        assert len(set(top.ravel())) >= 6, "most of the 8 experts are used"
        assert len({tuple(sorted(t)) for t in top}) >= 6, "tokens choose different pairs of experts"


def test_transformers_saves_one_tensor_per_expert(saved):
    """transformers 5.25 holds the experts fused ([Ex, 2Fx, E] gate_up_proj) but save_pretrained
    converts them back to the published layout: one tensor per expert and projection."""
    case, hf_model, path = saved
    cfg = hf_model.config
    names = set(load_file(path / "model.safetensors"))
    moe = {n for n in names if ".mlp.gate." in n or ".experts." in n or "block_sparse_moe" in n}
    assert moe == expert_names(case, cfg.num_hidden_layers, cfg.num_local_experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_model.state_dict()


def test_the_fused_in_memory_layout_loads_the_same_parameters(saved, tmp_path):
    _, hf_model, path = saved
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.1.mlp.gate.weight"} <= names
    assert_same_params(from_pretrained(tmp_path), from_pretrained(path))


@pytest.mark.parametrize("family,param_dtype", [("qwen3_moe", "float32"), ("mixtral", "bfloat16")])
def test_our_save_loads_back_exactly_here_and_in_transformers(family, param_dtype, tmp_path):
    """Our save -> our load: the same parameters, bit for bit. Our save -> transformers: no tensor
    missing or left over, and its fused experts are ours transposed."""
    import jax.numpy as jnp

    dtype = jnp.dtype(param_dtype)
    config = tiny(family, num_layers=3)
    ours = Transformer(config, rngs=nnx.Rngs(1), param_dtype=dtype)
    save_pretrained(ours, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert expert_names(family, 3, config.num_experts) <= names
    assert_same_params(from_pretrained(tmp_path, param_dtype=dtype), ours)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert type(hf).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    assert not any(info.values()), info
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    ps = {k[-1]: v.astype(np.float32) for k, v in params_of(ours).items() if k[0] == "layers"}
    Fx = config.moe_intermediate_size
    for i in range(3):
        p = f"model.layers.{i}.mlp."
        np.testing.assert_array_equal(sd[p + "gate.weight"], ps["router"][i].T)
        np.testing.assert_array_equal(sd[p + "experts.gate_up_proj"][:, :Fx], ps["expert_gate"][i].transpose(0, 2, 1))
        np.testing.assert_array_equal(sd[p + "experts.gate_up_proj"][:, Fx:], ps["expert_up"][i].transpose(0, 2, 1))
        np.testing.assert_array_equal(sd[p + "experts.down_proj"], ps["expert_down"][i].transpose(0, 2, 1))


def _rewrite(src, dst, change) -> None:
    """Copy the checkpoint directory `src` to `dst` with its tensors dict passed through `change`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_misshaped_or_unused_expert_tensor_is_named(tmp_path):
    src = tmp_path / "src"
    build_hf_model("qwen3_moe").save_pretrained(src)
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    cases = {
        "missing": (lambda t: t.pop(name), f"missing tensor '{name}'"),
        "shape": (lambda t: t.update({name: t[name][:, :-1].copy()}), f"'{name}' has shape"),
        "extra": (lambda t: t.update({"model.layers.1.mlp.experts.8.down_proj.weight": t[name]}),
                  "experts.8.down_proj"),
        # Both layouts at once: the fused one is read, the per-expert tensors are left over.
        "both": (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((8, 64, 64), np.float32),
                                     "model.layers.0.mlp.experts.down_proj": np.zeros((8, 64, 32), np.float32)}),
                 "model.layers.0.mlp.experts.0"),
    }
    for label, (change, message) in cases.items():
        _rewrite(src, tmp_path / label, change)
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")):
            from_pretrained(tmp_path / label)


def _qwen3_moe_config_json(**changes) -> dict:
    cls, kwargs = CASES["qwen3_moe"]
    d = cls(**kwargs).to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,dense", [
    (dict(mlp_only_layers=[1]), (1,)),
    (dict(decoder_sparse_step=2), (0,)),
    (dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), (0, 2, 3)),
])
def test_a_qwen3_moe_stacks_dense_layers_are_read_and_written(changes, dense):
    """transformers' rule: experts where a layer is not in mlp_only_layers and (i + 1) %
    decoder_sparse_step == 0; ours writes the same stack back (as mlp_only_layers, step 1)."""
    cfg = config_from_hf(_qwen3_moe_config_json(**changes))
    assert cfg.dense_layers == dense and set(cfg.sparse_layers) == set(range(cfg.num_layers)) - set(dense)
    written = config_to_hf(cfg, dtype_name="float32")
    assert written["mlp_only_layers"] == list(dense) and written["decoder_sparse_step"] == 1
    assert config_from_hf(written) == cfg


def test_a_qwen3_moe_stack_without_an_expert_layer_is_refused():
    with pytest.raises(UnsupportedModelError) as e:
        config_from_hf(_qwen3_moe_config_json(num_experts=0, num_local_experts=0))
    assert isinstance(e.value, ConfigError) and "every layer a dense MLP" in str(e.value)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_a_sparse_step_stack_matches_transformers_and_round_trips(norm_topk_prob, tmp_path):
    """decoder_sparse_step=2 over 4 layers (dense 0 and 2): logits within 1e-4 of transformers'
    (left-padded rows), ours saved and loaded back by transformers, and the unrolled layers equal
    the scan. (The mlp_only_layers stack runs the whole parity suite: hf_models' qwen3_moe_mixed.)"""
    from hf_models import randomize_

    cls, kwargs = CASES["qwen3_moe"]
    config = cls(**{**kwargs, "num_hidden_layers": 4, "decoder_sparse_step": 2, "norm_topk_prob": norm_topk_prob},
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf_model = randomize_(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
                          .float().eval())
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert ours.config.dense_layers == (0, 2) and ours.config.norm_topk_prob is norm_topk_prob
    ids, mask = left_padded_batch(config.vocab_size, [12, 7, 3])

    def torch_out(model):
        with torch.no_grad():
            return model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                         attention_mask=torch.as_tensor(mask)).logits.numpy()

    want, real = torch_out(hf_model), mask.astype(bool)
    got = np.asarray(ours(ids, attention_mask=mask))
    assert np.abs(got - want)[real].max() <= 1e-4 * max(1.0, np.abs(want[real]).max())
    unrolled = from_pretrained(tmp_path / "hf", scan_layers=False)
    np.testing.assert_allclose(np.asarray(unrolled(ids, attention_mask=mask))[real], got[real], atol=1e-5)
    save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    np.testing.assert_allclose(torch_out(back)[real], want[real], atol=1e-4)
    assert_same_params(from_pretrained(tmp_path / "ours"), ours)


def test_mixtral_router_jitter_is_refused():
    cls, kwargs = CASES["mixtral"]
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise=0.1"):
        config_from_hf(cls(**kwargs, router_jitter_noise=0.1).to_dict())


# Qwen/Qwen3-30B-A3B's config.json as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_is_the_bench_preset():
    from grpo_jax.tools.bench.parity import preset_config

    ours = config_from_hf(QWEN3_30B_A3B)
    assert ours == preset_config("qwen3-30b-a3b").replace(pad_token_id=None)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.norm_topk_prob) == (
        128, 8, 768, True)
    written = config_to_hf(ours, dtype_name="bfloat16")
    assert {k: written[k] for k in QWEN3_30B_A3B if k in written and k != "torch_dtype"} == {
        k: v for k, v in QWEN3_30B_A3B.items() if k in written and k != "torch_dtype"}
    hf = transformers.AutoConfig.for_model(**written)
    assert (hf.num_experts, hf.norm_topk_prob, hf.mlp_only_layers, hf.head_dim) == (128, True, [], 128)


def test_transformers5_config_json_names_experts_num_local_experts(saved):
    """transformers 5 writes Qwen3-MoE's `num_experts` under its alias `num_local_experts`; both read."""
    case, hf_model, path = saved
    d = json.loads((path / "config.json").read_text())
    assert d["num_local_experts"] == 8 and "num_experts" not in d
    if case == "qwen3_moe":
        d["num_experts"] = d.pop("num_local_experts")
    assert config_from_hf(d).num_experts == 8
    assert config_from_hf(d) == config_from_hf(config_to_hf(config_from_hf(d), dtype_name="float32"))


def test_loading_holds_the_experts_once(tmp_path):
    """Host memory while reading: the result plus about one tensor, not a list of layers and their
    stack (which peaked at 2x the parameters)."""
    config = tiny("qwen3_moe", num_layers=4, num_experts=32, moe_intermediate_size=64, vocab_size=64)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path)
    reader = TensorReader(tmp_path)
    tracemalloc.start()
    try:
        values = read_values(reader, config, tmp_path, np.float32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        reader.close()
    total = sum(v.nbytes for v in values.values())
    assert total > 5e6 and peak < 1.2 * total, f"peak {peak:,} bytes for {total:,} bytes of parameters"
