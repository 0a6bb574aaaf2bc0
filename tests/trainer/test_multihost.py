"""Multi-host training: two processes with 4 CPU devices each (jax.distributed on localhost, gloo
collectives) end exactly where one process with 8 devices ends, on a (2, 2, 2) mesh, with the static
sampler and with the paged engine (the default, its page loop: fewer slots than rows).

Every run is the demo config shortened to a 2-step warm start and 2 GRPO steps, all started at
once, each process in its own interpreter (tests/multihost_worker.py: its own device count); the
one-process runs share one interpreter, one after another. On
two hosts each process loads only its half of every batch, only process 0 writes the run
directory's logs, and both write the checkpoint. Before training, the two processes also place a
tiny HF model on a mesh over both of them, with no cross-host gather. (Sharded == one device is checked step by step
in tests/runtime/test_sharding.py, pmap == jit in tests/learner/test_parallel.py: the same train_step.)
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from runs import CONFIG

from grpo_jax.trainer.checkpoint import load_policy
from grpo_jax.config import ConfigError, apply_overrides, config_from_dict
from grpo_jax.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "multihost_worker.py"
STEPS = 2
PROMPTS = 32  # the demo's data.prompts_per_step
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
STATIC = ["sampling.engine=static"]
# The paged engine's 64 slots (16 per row shard) for the 256 rows of a step: refills happen.
ENGINE = ["sampling.engine=paged", "sampling.slots=64"]
# name: overrides. The runs on one process with 8 devices, one after another in one interpreter
# (tests/multihost_worker.py), and the same runs on two processes with 4 devices each, each run a
# pair of interpreters of its own (run after run in one pair, the paged engine's once hung in CI).
# The sampler on 4 of the devices (2 per process), the learner on the other 4, one step stale.
SPLIT = ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "rollout.sampler_devices=4", "rollout.staleness=1"]
ONE = {"mesh": MESH + STATIC, "cmesh": MESH + ENGINE, "smesh": SPLIT}
TWO = {"multi": MESH + STATIC, "cmulti": MESH + ENGINE, "smulti": SPLIT}
# group: (devices per process, processes, runs)
GROUPS = {"one": (8, 1, ONE), **{name: (4, 2, {name: extra}) for name, extra in TWO.items()}}


def overrides(tfds_dir: Path) -> list[str]:
    """The demo config, shortened. The evaluation has the train sampler's shape (no extra compile).
    From so short a warm start no answer is right yet, so DAPO's overlong penalty (which ranks
    completions by length) is added: the groups' rewards differ and the GRPO steps have real
    advantages. A large Adam epsilon (the warm start's AdamW uses it too): with 1e-8, Adam's first
    steps, lr * g / (|g| + eps), turn float-rounding differences of near-zero gradients into
    lr-sized ones and hide what is compared. Advantages are RLOO-centred and scaled by the whole
    batch's std: computed per host, two hosts would each divide by their own half's std."""
    return [f"data.data_dir={tfds_dir}", "sft.steps=2", f"train.steps={STEPS}", "train.warmup_steps=0",
            "train.learning_rate=0.001", "train.adam_eps=0.001", "train.samples_every=1", "train.progress=false",
            "rewards=[{name: math_accuracy}, {name: overlong, kwargs: {max_length: 4, cache_length: 3}}]",
            "eval.num_prompts=32", "eval.k=8", "eval.every=0", "checkpoint.every=0",
            "grpo.advantage_scale=batch", "grpo.advantage_estimator=rloo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(path: Path) -> dict:
    with np.load(path) as f:
        out = {k: f[k] for k in f.files}
    out["metrics"] = json.loads(str(out["metrics"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    tfds_dir = tmp / "tfds"
    demo = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())["data"]
    from grpo_jax.data import load_source

    for split in ("train", "test"):  # built once here, not by every process at once
        load_source(demo["name"], split, data_dir=str(tfds_dir), builder_config=demo["builder_config"],
                    **demo["builder_kwargs"])
    env = dict(os.environ)  # conftest's compile flags, less its device count (each worker sets its own)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    from hf_models import build_hf_model

    build_hf_model("qwen3").save_pretrained(tmp / "hf")  # placed by the 2-process run (check_placement)
    procs = []
    for group, (devices, nproc, runs) in GROUPS.items():
        port = free_port()
        (tmp / f"out_{group}").mkdir()
        listing = [{"name": name, "run_dir": str(tmp / name), "overrides": overrides(tfds_dir) + extra}
                   for name, extra in runs.items()]
        (tmp / f"{group}.json").write_text(json.dumps(listing))
        for pid in range(nproc):
            cmd = [sys.executable, str(WORKER), str(tmp / f"out_{group}"), str(devices), str(nproc), str(pid), str(port),
                   str(tmp / f"{group}.json")]
            log = open(tmp / f"{group}{pid}.log", "w")
            run_env = dict(env, GRPO_TEST_PLACEMENT_MODEL=str(tmp / "hf")) if group == "multi" else env
            procs.append((group, pid, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env), log))
    failed = []
    try:
        for group, pid, proc, log in procs:
            try:
                code = proc.wait(timeout=600 * len(GROUPS[group][2]))  # 10 minutes a run
            except subprocess.TimeoutExpired:
                code = "timeout"
            log.close()
            if code != 0:
                failed.append(f"{group} process {pid} exited {code}:\n" + (tmp / f"{group}{pid}.log").read_text()[-4000:])
                break
    finally:
        for _, _, proc, _ in procs:
            proc.kill()
    if failed:
        pytest.fail("\n\n".join(failed))
    out = {name: load(tmp / f"out_{group}" / f"{name}.process0.npz") for group, (_, _, runs) in GROUPS.items()
           for name in runs}
    for name in TWO:
        out[f"{name}1"] = load(tmp / f"out_{name}" / f"{name}.process1.npz")
    out["dirs"] = {name: tmp / name for name in (*ONE, *TWO)}
    return out


def params(run: dict, kind: str) -> list[np.ndarray]:
    return [run[f"{kind}/{i}"] for i in range(sum(k.startswith(kind + "/") for k in run))]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b) and [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def assert_same_metrics(got: list[dict], ref: list[dict], what: str) -> None:
    assert len(got) == len(ref) == STEPS
    for m, r in zip(got, ref):
        for key, value in r.items():
            if key.startswith("perf/") or value is None or (isinstance(value, float) and np.isnan(value)):
                continue
            # The noise scale is a difference of nearly equal sums over a squared norm: its float
            # rounding is relative to its size (~50 rows here), not absolute.
            rel = 1e-5 if key == "health/grad_noise_scale" else None
            assert m[key] == pytest.approx(value, abs=1e-5, rel=rel), (what, key)


def test_two_processes_end_with_the_parameters_of_one_process_on_eight_devices(runs):
    p0, p1 = params(runs["multi"], "final"), params(runs["multi1"], "final")
    # Each process's copy comes from its own devices' shards: the data-parallel replicas agree.
    assert max_diff(p0, p1) == 0.0
    assert max_diff(p0, params(runs["mesh"], "final")) <= 1e-5
    assert max_diff(params(runs["multi"], "warm"), params(runs["mesh"], "warm")) <= 1e-5
    for name in ("multi", "multi1"):  # every process sees the metrics of the whole batch
        assert_same_metrics(runs[name]["metrics"], runs["mesh"]["metrics"], name)
    # The two GRPO steps did move the parameters, by far more than the tolerance, with real advantages.
    ref = runs["mesh"]
    assert max_diff(params(ref, "final"), params(ref, "warm")) > 1e-4
    assert ref["metrics"][-1]["kl/k3"] > 0 and min(m["groups/frac_zero_std"] for m in ref["metrics"]) < 1


def test_the_paged_engine_on_two_processes_ends_where_one_process_ends(runs):
    """Each host's engine fills its own slots from its own prompts; the finished groups are put
    together as the static engine's are, so two processes train exactly as one on eight devices."""
    p0, p1 = params(runs["cmulti"], "final"), params(runs["cmulti1"], "final")
    assert max_diff(p0, p1) == 0.0
    assert max_diff(p0, params(runs["cmesh"], "final")) <= 1e-5
    for name in ("cmulti", "cmulti1"):
        assert_same_metrics(runs[name]["metrics"], runs["cmesh"]["metrics"], name)
    # The engines draw differently (per sequence, per step), so the runs did not sample alike.
    assert max_diff(params(runs["cmesh"], "final"), params(runs["mesh"], "final")) > 1e-6


def test_split_meshes_with_staleness_on_two_processes_end_where_one_process_ends(runs):
    """Sampler and learner on their own devices of both hosts, the parameters copied between them
    device to device (no Pathways) and the batches one step stale: as on one process."""
    p0, p1 = params(runs["smulti"], "final"), params(runs["smulti1"], "final")
    assert max_diff(p0, p1) == 0.0
    assert max_diff(p0, params(runs["smesh"], "final")) <= 1e-5
    for name in ("smulti", "smulti1"):
        assert_same_metrics(runs[name]["metrics"], runs["smesh"]["metrics"], name)
    assert [m["rollout/staleness"] for m in runs["smesh"]["metrics"]] == [0.0, 1.0]
    assert all(m["perf/weight_sync_s"] > 0 for m in runs["smulti"]["metrics"])


def test_a_model_is_placed_over_both_hosts_without_gathering_it(runs):
    for name in ("multi", "multi1"):
        run = runs[name]
        *ways, old = run["placement/calls"]
        # from_pretrained(mesh=), place_model from a device, from host memory (a reward model's
        # way) and of a model drawn there (init_on_host) make no cross-process call; the old way (a
        # device_put of a default-device array onto the mesh) does, so the count would see one.
        assert list(ways) == [0, 0, 0, 0] and old > 0, name
        assert float(run["placement/diff"]) == 0.0, name  # every addressable shard is the model's slice
        per_device, whole = run["placement/device_bytes"], int(run["placement/model_bytes"])
        assert len(per_device) == 4 and per_device.max() < whole / 4, (name, per_device, whole)  # fsdp 4 x tensor 2
        print(f"{name}: peak {per_device.max()} bytes per device, whole model {whole} bytes")


def test_each_host_loads_only_its_half_of_the_prompts(runs):
    assert int(runs["mesh"]["rows_read"]) == STEPS * PROMPTS
    assert int(runs["multi"]["rows_read"]) == int(runs["multi1"]["rows_read"]) == STEPS * PROMPTS // 2


def test_process_zero_alone_writes_logs_and_both_write_the_checkpoint(runs):
    run_dir = runs["dirs"]["multi"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # one writer: no record twice
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == [1, 2] and len(samples) == len({json.dumps(r) for r in samples})
    assert (run_dir / "metrics.png").exists()
    # Saved by two processes on a (2, 2, 2) mesh, restored here by one on its first device.
    model, _, files = load_policy(run_dir)
    assert files.step == STEPS
    assert max_diff([np.asarray(x) for x in jax.tree.leaves(model)], params(runs["multi"], "final")) == 0.0


def test_a_batch_that_does_not_split_over_the_devices_fails_before_compiling(tmp_path):
    cfg = copy.deepcopy(CONFIG)
    cfg["data"]["prompts_per_step"] = 6
    with pytest.raises(ConfigError, match="multiple of the 8 ways"):
        train(config_from_dict(apply_overrides(cfg, ["parallelism=pmap"])), tmp_path / "x")
    with pytest.raises(ConfigError, match="not divisible by 3"):
        train(config_from_dict(apply_overrides(cfg, ["mesh.data=3", "mesh.fsdp=-1"])), tmp_path / "y")
