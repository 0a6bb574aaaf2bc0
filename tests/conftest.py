"""Test setup: 8 emulated CPU devices (set before JAX is imported), float32 matmuls, and every cache
in one temporary directory of this test run.

Caches: no test reads or writes the user's caches. GRPO_JAX_CACHE (gguf conversions, fetched models,
remote model copies), GRPO_JAX_STAGING (remote runs' staging), and those of the libraries tests use:
Hugging Face (HF_HOME; the variables that would override it are dropped), TFDS (TFDS_DATA_DIR),
matplotlib (MPLCONFIGDIR), torch (TORCH_HOME), and XDG_CACHE_HOME for anything else that follows it
(pip, ...). They are set here, before anything is imported, so subprocesses the tests start inherit
them. pytest-xdist's workers of one run share the directory, made by the controller and removed
when it exits. JAX keeps no persistent compilation cache unless asked: here it is asked for, inside
the run's directory.
"""

import atexit
import gc
import os
import shutil
import tempfile

# Compile for speed of compiling: the suite's programs are tiny and each runs a few times, so XLA's
# compile time is most of the suite's time. LLVM's optimisation level 0 and XLA's classic CPU
# emitters compile the suite's programs about 40% faster (measured on tests/engine/test_sampling.py)
# with the same results to the tests' tolerances. Flags the caller set come later and win; the
# library and the benchmarks keep XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    TEST_XLA_FLAGS + " " + os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU client runs each device's part of a program on a pool of max(cores, devices) threads: 8
# here. Two programs with collectives in flight at once (dispatched back to back, neither waiting on
# the other) can fill it with parts waiting at a rendezvous for parts that never get a thread, and
# the process aborts after 40 s: two 8-device programs dispatched in turn aborted in 3 of 3 tries
# with the default pool and finished in 4 of 4 with 16 threads (tests/runtime/test_cpu_thread_pool.py;
# seen once in the multi-host test's one-process run). PJRT_NPROC sizes the pool, and Eigen's: two
# test files ran in 67.6 and 67.2 s with it, 71.3 and 69.5 s without (benchmarks/results/ci/2026-12-06.json).
os.environ.setdefault("PJRT_NPROC", "16")  # the subprocesses tests start (multi-host workers, the CLI) inherit it


def _test_cache_root() -> str:
    """The run's directory: made by the process pytest starts (xdist's controller, or the only one)
    and removed when it exits; xdist's workers inherit it through GRPO_JAX_TEST_ROOT."""
    root = os.environ.get("GRPO_JAX_TEST_ROOT")
    if root and os.environ.get("PYTEST_XDIST_WORKER"):
        return root
    root = tempfile.mkdtemp(prefix="grpo_jax_tests_")
    os.environ["GRPO_JAX_TEST_ROOT"] = root
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


_ROOT = _test_cache_root()
for _var, _sub in {"GRPO_JAX_CACHE": "grpo_jax", "GRPO_JAX_STAGING": "grpo_jax_runs", "XDG_CACHE_HOME": "xdg",
                   "HF_HOME": "huggingface", "TFDS_DATA_DIR": "tensorflow_datasets", "MPLCONFIGDIR": "matplotlib",
                   "TORCH_HOME": "torch"}.items():
    os.environ[_var] = os.path.join(_ROOT, _sub)
# One persistent JAX compilation cache for the run: the two xdist workers and every subprocess a
# test starts (the CLI, the multi-host workers) compile many of the same tiny programs; a program
# compiled once is loaded by the others. Every program is kept (no minimum compile time or size).
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_ROOT, "jax_compilation_cache")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
for _var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_ASSETS_CACHE", "HF_MODULES_CACHE",
             "HF_DATASETS_CACHE", "HF_XET_CACHE"):  # each would win over HF_HOME
    os.environ.pop(_var, None)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The slowest files first: CI runs the suite on 2 xdist workers by file (`--dist loadfile`), which
# hands out files in collection order with the test command's --no-loadscope-reorder (without it,
# xdist >= 3.5 re-sorts them by their number of tests and this order only breaks ties), so
# starting the long ones early keeps both workers busy to the end instead of leaving one of them
# alone with a long file at the tail. The order: each file's test
# time in a profile of the suite (benchmarks/results/ci/2026-12-06.json), the two GGUF files first.
SLOW_FIRST = ("test_gguf.py", "test_gguf_gemma3.py", "test_multihost.py", "test_episodes.py", "test_loop.py",
              "test_lora.py", "test_pipeline.py", "test_paged.py", "test_reward_training.py", "test_sampling.py",
              "test_preemption.py", "test_moe_routing.py", "test_critic_distill.py", "test_bench_memory.py",
              "test_moe_replay.py", "test_bench_tpu.py", "test_models_parity.py", "test_episodes_train.py",
              "test_vapo.py", "test_stability_runs.py", "test_engine.py", "test_files.py", "test_shared_prompt.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept


# Each program XLA:CPU compiles keeps ~17 memory mappings until its executable is freed, and jit's
# caches keep every executable alive. A worker that runs half the suite compiles thousands of programs:
# past the kernel's vm.max_map_count (65530 by default) the next mmap fails and LLVM segfaults inside
# the next compile (CI's workers died so in the Gemma 3 GGUF test, 60k mappings in). After each test
# file, a worker holding many mappings drops jit's caches; programs needed again come back from the
# run's persistent compilation cache.
MAPPINGS_BEFORE_CLEARING = 25_000


def mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    if mapped_regions() > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()
