"""`grpo-jax bench memory`: a tiny config's programs compiled on abstract shapes, their figures per
device, what model.remat changes, and the run in its own process when the device count differs."""

from __future__ import annotations

import json

from runs import CONFIG, write_config

from grpo_jax import cli
from grpo_jax.tools.bench.memory import CHIPS, with_device_count
from grpo_jax.tools.bench.programs import NOT_ASKED

PROGRAMS = ("sampler", "eval_sampler", "reference", "train_step")  # CONFIG has grpo.beta > 0: a reference pass
FIGURES = ("argument_bytes", "output_bytes", "temp_bytes")


def _bench(tmp_path, name, *options):
    config = {**CONFIG, "mesh": {"data": 1, "fsdp": 4, "tensor": 1}, "eval": {"num_prompts": 8, "k": 2}}
    out = tmp_path / f"{name}.json"
    argv = ["bench", "memory", "--config", write_config(tmp_path, config), "--output", str(out), *options]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_memory_of_each_program_per_device_and_block_remat_lowers_the_train_step(tmp_path, capsys):
    # conftest's 8 host devices: measured in this process, on 4 of them (mesh.fsdp: 4).
    none = _bench(tmp_path, "none", "--devices", "8", "--set", "train.micro_batches=4")
    table = capsys.readouterr().err
    assert "train_step" in table and "fits on v5e (16 GiB)" in table
    assert (none["devices"], none["mesh"], none["chip"], none["hbm_bytes"]) == (
        4, {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}, "v5e", CHIPS["v5e"])
    assert tuple(none["programs"]) == PROGRAMS and none["not_compiled"] == {}
    for name, p in none["programs"].items():
        assert all(p[k] > 0 for k in FIGURES), (name, p)
        assert p["peak_bytes"] == (p["held_bytes"] + p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"]
                                   + p["temp_bytes"] + p["generated_code_bytes"])
    # Per device, float32: every parameter splits over fsdp = 4 (its embed axis) except the q/k norms
    # (2 layers x 2 x head_dim 16, no embed axis), which every device holds whole.
    resident, norms = none["resident_bytes"], 2 * 2 * 16 * 4
    assert resident["params"] == (none["model"]["parameters"] * 4 - norms) // 4 + norms
    assert resident["reference"] == resident["params"] and resident["optimizer"] > 2 * resident["params"]  # Adam
    train = none["programs"]["train_step"]
    # The state is donated: its buffers come back as the new state's.
    assert train["alias_bytes"] >= resident["params"] + resident["optimizer"]
    assert train["held_bytes"] == resident["reference"]  # what it does not take: the KL reference
    assert none["peak_bytes"] == max(p["peak_bytes"] for p in none["programs"].values())
    assert none["margin_bytes"] == CHIPS["v5e"] - none["peak_bytes"] and none["verdict"] == "fits"

    block = _bench(tmp_path, "block", "--devices", "8", "--set", "train.micro_batches=4", "--set", "model.remat=block",
                   "--programs", "sampler,train_step")  # (the two compared)
    assert block["model"]["remat"] == "block"
    assert block["programs"]["train_step"]["temp_bytes"] < 0.8 * train["temp_bytes"]
    # Passes without gradients are the same programs.
    assert block["programs"]["sampler"]["temp_bytes"] == none["programs"]["sampler"]["temp_bytes"]


def test_another_device_count_is_measured_in_a_process_of_its_own(tmp_path):
    two = _bench(tmp_path, "two", "--devices", "2", "--set", "mesh={data: -1}", "--set", "grpo.beta=0",
                 "--chip", "v6e", "--programs", "reference,train_step")  # (--programs goes to the process too)
    assert two["devices"] == 2 and two["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 1}
    assert two["hbm_bytes"] == CHIPS["v6e"] and two["not_compiled"]["reference"].startswith("grpo.beta = 0")
    assert two["not_compiled"]["sampler"] == NOT_ASKED and list(two["programs"]) == ["train_step"]
    assert two["programs"]["train_step"]["temp_bytes"] > 0
    assert with_device_count("--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", 2) == (
        "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2")


def test_a_remote_model_path_without_a_preset_is_one_line(tmp_path, capsys):
    config = {**CONFIG, "model": {"path": "gs://bucket/models/Qwen3-0.6B"}}
    argv = ["bench", "memory", "--config", write_config(tmp_path, config), "--devices", "8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-jax bench memory: error: ") and "--preset NAME" in err and err.count("\n") == 1


def test_a_critic_model_and_a_teacher_are_counted(tmp_path):
    """`ppo.critic: model` holds a second copy of the weights with its own Adam moments; a teacher
    is resident with a program of its own. (In this process, on 4 of conftest's 8 devices; only the
    program each adds is compiled: the resident bytes need none.)"""
    critic = _bench(tmp_path, "critic", "--devices", "8", "--set", "algorithm=ppo", "--set", "ppo.critic=model",
                    "--programs", "train_step")
    resident = critic["resident_bytes"]
    # The policy's moments (2 P), the critic's trunk (P) and its moments (2 P), the heads besides.
    assert resident["optimizer"] > 5 * resident["params"] and resident["teacher"] == 0
    teacher_dir = tmp_path / "teacher"
    from grpo_jax.config import config_from_dict
    from grpo_jax.models import save_pretrained
    from grpo_jax.models.build import architecture, build_tokenizer
    from flax import nnx
    from grpo_jax.models import Transformer

    tok = build_tokenizer(config_from_dict(CONFIG).model)
    teacher = Transformer(architecture({**CONFIG["model"]["architecture"], "num_layers": 3}, tok), rngs=nnx.Rngs(0))
    save_pretrained(teacher, teacher_dir, tokenizer=tok)
    distill = _bench(tmp_path, "distill", "--devices", "8", "--set", "algorithm=distill",
                     "--set", f"distill.teacher={teacher_dir}", "--programs", "teacher")
    assert "teacher" in distill["programs"]
    # A 3-layer teacher of the 2-layer policy's width: more than the policy, less than twice it.
    assert distill["resident_bytes"]["params"] < distill["resident_bytes"]["teacher"] < \
        2 * distill["resident_bytes"]["params"]


def test_programs_compiles_only_the_named_ones(tmp_path, capsys):
    only = _bench(tmp_path, "only", "--devices", "8", "--programs", "train_step")
    assert tuple(only["programs"]) == ("train_step",) and only["programs"]["train_step"]["temp_bytes"] > 0
    assert only["not_compiled"] == {name: "not asked (--programs)" for name in ("sampler", "eval_sampler", "reference")}
    assert only["peak_program"] == "train_step" and "not asked: --programs" in only["verdict_line"]
    assert cli.main(["bench", "memory", "--config", write_config(tmp_path, CONFIG), "--programs", "train,sampler"]) == 2
    assert "unknown train" in capsys.readouterr().err


def test_a_packing_run_compiles_its_packed_passes_at_their_largest(tmp_path):
    # train.packing: the train step and the reference pass are compiled with the packing plan of a
    # step whose every row is as long as the run allows: one row per bin, bins of prompt + completion.
    options = ("--devices", "8", "--programs", "train_step,reference", "--set", "train.micro_batches=2")
    packed = _bench(tmp_path, "packed", *options, "--set", "train.packing=true")
    plain = _bench(tmp_path, "plain", *options)
    work = packed["workload"]
    assert "packing" not in plain["workload"]
    assert work["packing"]["bin_length"] == work["prompt_len"] + work["completion_len"]
    assert work["packing"]["bins_per_micro_batch"] == work["rows"] // work["micro_batches"]
    for name in ("train_step", "reference"):
        p, q = packed["programs"][name], plain["programs"][name]
        assert p["compiled"] and p["temp_bytes"] > 0
        assert p["flops"] != q["flops"], name  # another program: the packed pass, not the plain one


def test_the_paged_sampler_holds_the_pool_it_is_given(tmp_path):
    # sampling.engine: paged: the sampler bench memory compiles is the paged engine, whose pages are
    # sampling.kv_cache_bytes per row shard whatever the lengths: 4 MiB more pool, 4 MiB more per device.
    options = ("--devices", "8", "--programs", "sampler", "--set", "sampling.engine=paged", "--set",
               "sampling.page_size=4", "--set", "sampling.slots=8")
    small, big = (_bench(tmp_path, f"paged{mib}", *options, "--set", f"sampling.kv_cache_bytes={mib << 20}")
                  for mib in (4, 8))
    grown = big["programs"]["sampler"]["temp_bytes"] - small["programs"]["sampler"]["temp_bytes"]
    assert (4 << 20) * 0.99 <= grown <= (4 << 20) * 1.5
