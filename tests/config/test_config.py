"""YAML configs: sections map onto the frozen dataclasses; bad keys fail with the nearest match."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from grpo_jax.config import (ConfigError, MeshConfig, RunConfig, apply_overrides, config_from_dict, config_to_dict,
                             load_config)

BASE = {
    "model": {"architecture": {"family": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                               "num_heads": 2, "num_kv_heads": 1, "head_dim": 16}, "tokenizer": "char"},
    "data": {"name": "arithmetic", "prompts_per_step": 4},
    "rewards": [{"name": "math_accuracy"}, {"name": "format", "weight": 0.1, "kwargs": {"require_reasoning": False}}],
    "sampling": {"group_size": 4, "max_new_tokens": 8, "stop_token_ids": [2]},
    "train": {"steps": 3, "learning_rate": 1e-3},
}


def write(tmp_path, raw) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_yaml_maps_onto_dataclasses_and_round_trips(tmp_path):
    config = load_config(write(tmp_path, BASE))
    assert config.train.steps == 3 and config.train.learning_rate == 1e-3
    assert config.sampling.stop_token_ids == (2,)  # YAML list -> the dataclass's tuple
    assert config.rewards[1].weight == 0.1 and config.rewards[1].kwargs == {"require_reasoning": False}
    assert config_from_dict(config_to_dict(config)) == config
    again = load_config(write(tmp_path, config_to_dict(config)))
    assert again == config


def test_overrides_are_parsed_as_yaml_and_validated(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.steps=7", "grpo.beta=0.04", "sampling.top_p=0.9",
                                                 "train.dynamic_sampling=true", "parallelism=jit"])
    assert (config.train.steps, config.grpo.beta, config.sampling.top_p) == (7, 0.04, 0.9)
    assert config.train.dynamic_sampling is True
    with pytest.raises(ConfigError, match="grpo.epsilon_low must be in"):
        load_config(write(tmp_path, BASE), ["grpo.epsilon_low=1.5"])
    with pytest.raises(ConfigError, match="train.steps must be an integer, got 'many'"):
        load_config(write(tmp_path, BASE), ["train.steps=many"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["train.steps"])


@pytest.mark.parametrize("raw,where,near", [
    ({"train": {"step": 3}}, "in train", "'steps'"),
    ({"trian": {"steps": 3}}, "top level", "'train'"),
    ({"sampling": {"group_sise": 4}}, "in sampling", "'group_size'"),
    ({"rewards": [{"name": "math_accuracy", "wieght": 1}]}, "rewards[0]", "'weight'"),
])
def test_unknown_key_names_the_valid_keys_and_the_nearest(tmp_path, raw, where, near):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {**BASE, **raw}))
    message = str(e.value)
    assert where in message and f"did you mean {near}" in message and "Valid keys:" in message


def test_unknown_override_key_names_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        load_config(write(tmp_path, BASE), ["train.learnin_rate=1"])
    with pytest.raises(ConfigError, match="did you mean 'sampling'"):
        load_config(write(tmp_path, BASE), ["samplng.group_size=2"])


def test_cross_section_checks():
    with pytest.raises(ValueError, match="at least 2 samples"):
        RunConfig(sampling=dataclasses.replace(RunConfig().sampling, group_size=1))
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        config_from_dict({"model": {"tokenizer": "char"}})
    with pytest.raises(ConfigError, match="eval.reward='nope'"):
        config_from_dict({**BASE, "eval": {"reward": "nope"}})
    with pytest.raises(ConfigError, match="micro_batches"):
        config_from_dict({**BASE, "train": {"micro_batches": 3}})
    with pytest.raises(ConfigError, match="max_prompt_tokens"):
        config_from_dict({**BASE, "data": {"max_prompt_tokens": 10_000}})


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_a_file_that_is_not_utf8_or_gives_a_key_twice_is_one_line_and_exit_2(tmp_path, capsys):
    from grpo_jax import cli

    cases = {"latin1.yaml": ("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 23: b'\\xe9'); save it as UTF-8"),
             "twice.yaml": (b"train:\n  steps: 3\n  learning_rate: 0.1\n  steps: 4\n",
                            "duplicate key 'steps' at line 4: give each key once")}
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        rc = cli.main(["train", "--config", str(tmp_path / name), "--output", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and err.count("\n") == 1, err
    # The same key in two mappings is fine.
    (tmp_path / "ok.yaml").write_text("train: {steps: 3}\nsft: {steps: 2}\n")
    assert load_config(tmp_path / "ok.yaml").sft.steps == 2


def test_set_reaches_nested_keys_of_mapping_settings(tmp_path):
    config = load_config(write(tmp_path, {**BASE, "data": {"builder_kwargs": {"num_train": 50}}}),
                         ["data.builder_kwargs.seed=3", "environment.name=calculator",
                          "environment.kwargs.limits.digits=4"])
    assert dict(config.data.builder_kwargs) == {"num_train": 50, "seed": 3}
    assert config.environment.kwargs["limits"] == {"digits": 4}
    with pytest.raises(ConfigError, match="did you mean 'builder_kwargs'"):
        load_config(write(tmp_path, BASE), ["data.builder_kwarg.seed=3"])
    with pytest.raises(ConfigError, match="data.builder_kwargs.seed is 3, not a mapping to set a key in"):
        apply_overrides({"data": {"builder_kwargs": {"seed": 3}}}, ["data.builder_kwargs.seed.x=1"])


def test_distributed_section(tmp_path):
    config = load_config(write(tmp_path, BASE), ["distributed.enabled=true", "distributed.num_processes=2",
                                                 "distributed.process_id=1",
                                                 "distributed.coordinator_address=127.0.0.1:1234"])
    assert config.distributed.enabled and config.distributed.process_id == 1
    with pytest.raises(ConfigError, match=r"process_id=2 is not in \[0, 2\)"):
        load_config(write(tmp_path, BASE), ["distributed.num_processes=2", "distributed.process_id=2"])
    with pytest.raises(ConfigError, match="did you mean 'coordinator_address'"):
        load_config(write(tmp_path, BASE), ["distributed.coordinator=x"])


def test_without_a_mesh_section_a_run_uses_every_device(tmp_path):
    from grpo_jax.runtime.devices import run_mesh

    config = load_config(write(tmp_path, {**BASE, "data": {"name": "arithmetic", "prompts_per_step": 8}}))
    mesh = run_mesh(config)
    assert mesh.devices.size == 8 and dict(mesh.shape) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    one = run_mesh(load_config(write(tmp_path, BASE), ["mesh.fsdp=1"]))
    assert one.devices.size == 1
    # Another axis taking the rest leaves fsdp at 1: `mesh.data: -1` alone is data parallelism.
    data = run_mesh(load_config(write(tmp_path, BASE), ["mesh.data=-1"]))
    assert dict(data.shape) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="at most one -1"):
        load_config(write(tmp_path, BASE), ["mesh.data=-1", "mesh.fsdp=-1"])


def test_mesh_expert_splits_the_experts_and_the_rows(tmp_path):
    from grpo_jax.runtime.devices import check_devices, run_mesh

    base = {**BASE, "data": {"name": "arithmetic", "prompts_per_step": 8}}
    config = load_config(write(tmp_path, base), ["mesh.expert=2"])
    assert config.mesh == MeshConfig(data=1, fsdp=-1, expert=2, tensor=1)  # fsdp still takes the rest
    assert dict(run_mesh(config).shape) == {"data": 1, "fsdp": 4, "expert": 2, "tensor": 1}
    alone = load_config(write(tmp_path, base), ["mesh.expert=-1"])
    assert dict(run_mesh(alone).shape) == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}
    check_devices(alone)  # 8 prompts over 8 row shards
    with pytest.raises(ConfigError, match="multiple of the 8 ways .* mesh.data x mesh.fsdp x mesh.expert"):
        check_devices(load_config(write(tmp_path, {**base, "data": {"name": "arithmetic", "prompts_per_step": 4}}),
                                  ["mesh.expert=-1"]))
    with pytest.raises(ConfigError, match="at most one -1"):
        load_config(write(tmp_path, base), ["mesh.expert=-1", "mesh.fsdp=-1"])


def test_pmap_takes_the_default_mesh_and_refuses_a_chosen_one(tmp_path):
    from grpo_jax.runtime.devices import check_devices

    base = {**BASE, "data": {"name": "arithmetic", "prompts_per_step": 8}, "parallelism": "pmap"}
    check_devices(load_config(write(tmp_path, base)))
    check_devices(load_config(write(tmp_path, base), ["mesh.fsdp=1"]))
    with pytest.raises(ConfigError, match="leave the mesh section out"):
        check_devices(load_config(write(tmp_path, base), ["mesh.fsdp=2"]))


def test_a_configured_pad_id_is_honoured_else_the_tokenizer_decides(tmp_path):
    from grpo_jax.data import char_tokenizer
    from grpo_jax.models.build import architecture
    from grpo_jax.trainer.prepare import resolve_sampling

    tok = char_tokenizer(add_bos=True)
    model_config = architecture(BASE["model"]["architecture"], tok)
    config = load_config(write(tmp_path, BASE))
    assert config.sampling.pad_token_id is None
    assert resolve_sampling(config.sampling, tok, model_config).pad_token_id == tok.pad_token_id
    chosen = resolve_sampling(load_config(write(tmp_path, BASE), ["sampling.pad_token_id=5"]).sampling, tok,
                              model_config)
    assert chosen.pad_token_id == 5
    too_big = load_config(write(tmp_path, BASE), [f"sampling.pad_token_id={model_config.vocab_size}"]).sampling
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        resolve_sampling(too_big, tok, model_config)
    # The sampler writes it after each completion's stop token.
    import jax
    from flax import nnx

    from grpo_jax.models import Transformer
    from grpo_jax.engine.sampling import generate

    model = Transformer(model_config, rngs=nnx.Rngs(0))
    config = dataclasses.replace(chosen, group_size=2, max_new_tokens=6, stop_token_ids=tuple(range(3, 60)),
                                 prompt_buckets=(8,))
    rollout = generate(model, [tok.encode("12+3=")], config, jax.random.key(0))
    tokens, mask = jax.device_get((rollout.tokens, rollout.mask))
    assert (mask == 0).any() and (tokens[mask == 0] == 5).all()


def test_a_shared_prompt_pass_needs_micro_batches_of_whole_groups(tmp_path):
    from grpo_jax.runtime.devices import check_devices

    base = {**BASE, "data": {"name": "arithmetic", "prompts_per_step": 8}, "train": {**BASE["train"],
                                                                                  "micro_batches": 2}}
    # 8 devices: one prompt (4 rows) per shard, which 2 micro-batches would split mid-group.
    with pytest.raises(ConfigError, match="train.shared_prompt runs each group's prompt once"):
        check_devices(load_config(write(tmp_path, base)))
    check_devices(load_config(write(tmp_path, base), ["train.shared_prompt=false"]))
    check_devices(load_config(write(tmp_path, base), ["mesh.fsdp=1"]))  # 8 prompts on one device


@pytest.mark.parametrize("override,message", [
    ("train.steps=1.5", "train.steps must be an integer, got 1.5"),
    ("sampling.group_size=2.5", "sampling.group_size must be an integer, got 2.5"),
    ("train.learning_rate=.inf", "train.learning_rate must be a finite number, got inf"),
    ("grpo.beta=.nan", "grpo.beta must be a finite number, got nan"),
    ("rewards=[{name: math_accuracy, weight: .nan}]", "rewards[0].weight must be a finite number, got nan"),
    ("data.template={questoin}", "data.template must be a string, got a mapping {'questoin': None}"),
    ("sampling.prompt_buckets=8", "sampling.prompt_buckets must be a list, got 8"),
    ("sampling.stop_token_ids=[2, two]", "sampling.stop_token_ids[1] must be an integer, got 'two'"),
    ("model.dtype=float16", "model.dtype must be one of ['float32', 'bfloat16'], got 'float16'"),
    ("model.remat=true", "model.remat must be one of ['none', 'block', 'dots', 'attention', 'offload'], got True"),
    ("grpo.sampler_is_mask=[1.2, 2.0]", "grpo.sampler_is_mask must be [low, high] with 0 <= low <= 1 <= high"),
    ("grpo.sampler_is_level=row", "grpo.sampler_is_level must be one of ['token', 'sequence'], got 'row'"),
    ("grpo.sampler_is_level=sequence", "set one of them too"),
    ("train.shared_prompt=1", "train.shared_prompt must be true or false, got 1"),
    ("algorithm=distill", "algorithm: distill needs distill.teacher"),
    ("distill.teacher=x", "the distill section applies only with algorithm: distill"),
    ("ppo.critic=value", "ppo.critic must be one of ['head', 'model'], got 'value'"),
    ("ppo.critic=model", "the ppo section applies only with algorithm: ppo"),
    ("ppo={critic_path: x, critic: head}", "ppo.critic_path initialises a separate critic model: set ppo.critic: "
     "model too"),
    ("ppo.value_warmup_steps=-1", "ppo.value_warmup_steps must be >= 0, got -1"),
    ("data.builder_kwargs=[1]", "data.builder_kwargs must be a mapping of keys to values, got a list [1]"),
    ("rewards=[{name: format, kwargs: {require_reasonin: false}}]",
     "rewards[0].kwargs: 'require_reasonin' is not an option of reward format_reward (did you mean "
     "'require_reasoning'?)"),
    ("rewards=[{name: no_such_module_xyz:fn}]", "rewards[0].name: reward 'no_such_module_xyz:fn': importing "
     "'no_such_module_xyz' failed: ModuleNotFoundError"),
    ("train.steps=[1,", "--set 'train.steps=[1,' is not valid YAML: while parsing a flow node"),
    ("data.template.a=3", "--set data.template.a: data.template is not a mapping setting; set it whole"),
])
def test_a_wrong_value_is_one_line_naming_its_key_before_anything_runs(tmp_path, capsys, override, message):
    from grpo_jax import cli

    rc = cli.main(["train", "--config", write(tmp_path, BASE), "--set", "mesh={data: 1, fsdp: 1, tensor: 1}",
                   "--set", override, "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert err.count("\n") == 1, err  # one line
    assert not (tmp_path / "run").exists()


def test_whole_floats_are_integers_and_integers_are_floats(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.steps=4.0", "train.learning_rate=1", "mesh.fsdp=null"])
    assert config.train.steps == 4 and type(config.train.steps) is int
    assert config.train.learning_rate == 1.0 and type(config.train.learning_rate) is float
    assert config.mesh.fsdp == -1  # null: the default (the rest of the devices)


def test_exponent_notation_without_a_dot_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-4 as a string; in a float field it is the number meant.
    config = load_config(write(tmp_path, BASE), ["train.learning_rate=1e-4", "ppo.critic_learning_rate=3E+0",
                                                 "algorithm=ppo"])
    assert config.train.learning_rate == 1e-4 and config.ppo.critic_learning_rate == 3.0
    with pytest.raises(ConfigError, match="train.steps must be an integer, got '1e2'"):
        load_config(write(tmp_path, BASE), ["train.steps=1e2"])
    with pytest.raises(ConfigError, match="train.learning_rate must be a number, got 'fast'"):
        load_config(write(tmp_path, BASE), ["train.learning_rate=fast"])


def test_a_ppo_section_without_algorithm_ppo_is_refused(tmp_path):
    # Accepted and ignored would be worse: GRPO never reads the critic's settings.
    with pytest.raises(ConfigError, match="applies only with algorithm: ppo"):
        load_config(write(tmp_path, BASE), ["ppo.lam_policy=0.9"])
    assert load_config(write(tmp_path, BASE), ["ppo.lam_policy=0.9", "algorithm=ppo"]).ppo.lam_policy == 0.9


def test_model_chat_template_gives_the_tokenizer_a_template_from_text_or_a_file(tmp_path):
    """model.chat_template: Jinja text or a .jinja file, set on the tokenizer (the char tokenizer
    has none of its own) and saved with it; anything else is refused by name."""
    from grpo_jax.models.build import build_tokenizer

    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    (tmp_path / "t.jinja").write_text(text.replace("<", "["))
    messages = [{"role": "user", "content": "1+2"}]
    for value, rendered in [(text, "<user>1+2>"), (str(tmp_path / "t.jinja"), "[user>1+2>")]:
        raw = {**BASE, "model": {**BASE["model"], "chat_template": value}}
        tok = build_tokenizer(load_config(write(tmp_path, raw)).model)
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    tok.save_pretrained(tmp_path / "saved")
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == text.replace("<", "[")
    for value, message in [("user: {content}", "neither Jinja"), (str(tmp_path / "missing.jinja"), "does not exist")]:
        raw = {**BASE, "model": {**BASE["model"], "chat_template": value}}
        with pytest.raises((ConfigError, FileNotFoundError), match=message):
            build_tokenizer(load_config(write(tmp_path, raw)).model)


def test_a_cosine_schedule_with_no_steps_past_its_warm_up_is_refused_by_name():
    from grpo_jax.config.reward_model import RMTrainConfig
    from grpo_jax.config.training import OptimizerConfig

    with pytest.raises(ValueError, match=r"train.warmup_steps \(30\) must be below train.steps \(10\)"):
        RMTrainConfig(steps=10, warmup_steps=30, lr_schedule="cosine")  # at load, not in optax at step 1
    RMTrainConfig(steps=10, warmup_steps=30)  # a constant schedule after a warm-up: fine
    OptimizerConfig(learning_rate=1.0, lr_schedule="cosine", warmup_steps=1, total_steps=2)
