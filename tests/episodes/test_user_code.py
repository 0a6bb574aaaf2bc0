"""User environments under time limits (grpo_jax.usercode, grpo_jax.env.workers): a user environment
named in the config lives in worker processes, so a call that hangs costs its own episode, no
thread of the trainer and no process for longer than the episodes that shared its worker; episodes
open side by side (also in the warm start's worked episodes); a worker that crashes fails only
what it held; a stop signal ends every wait at once. The trainer's own pool of threads (built-in
environments) is bounded too."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest

from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.env.registry import environment_maker
from grpo_jax.env.workers import WorkerEnvironments
from grpo_jax.episodes.episode import Episode, EpisodeLimits
from grpo_jax.episodes.runner import EpisodeRunner, worked_episodes
from grpo_jax.trainer.preemption import StopSignals
from grpo_jax.usercode.calls import LocalPool

TEMPLATE = ("{% for m in messages %}{{ '[' + m.role + ']' + m.content + eos_token + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")
TOK = char_tokenizer(add_bos=True, chat_template=TEMPLATE)
ENV = '''
import os, time
from grpo_jax import EnvStep

class Moody:
    """Opens in the example's `reset_s` seconds; a turn "hang" never returns, "crash" ends its
    process, "gil" holds the worker's GIL for good, "bye" ends the episode, any other is answered in
    capitals."""
    tool_call_end = "</x>"

    def reset(self, example):
        time.sleep(example.get("reset_s", 0.0))
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, completion):
        if completion == "hang":
            time.sleep(3600)
        if completion == "crash":
            os._exit(3)
        if completion == "gil":  # a C call holding the GIL: the worker reads nothing more
            import re
            re.match(r"(a+)+$", "a" * 40 + "b")
        return EnvStep([{"role": "tool", "content": completion.upper()}], done=completion == "bye")
'''


@pytest.fixture(scope="module")
def moody(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_env") / "moody.py"
    path.write_text(ENV)
    return f"{path}:Moody"


def play(ep: Episode, text: str):
    """Start the turn `text` (ended by <eos>) -> the environment's call."""
    sampled = TOK(text + "<eos>", add_special_tokens=False)["input_ids"]
    return ep.add_turn(sampled, [0.0] * len(sampled), stopped=True)


def test_a_hanging_environment_costs_its_episode_and_no_thread_over_8_steps(moody):
    make = environment_maker(moody, {}, TOK, workers=2)
    assert isinstance(make, WorkerEnvironments)  # a user environment runs in worker processes
    limits = EpisodeLimits(max_model_tokens=64, timeout_s=0.25)  # short (it hangs 8 times), with room for a loaded machine
    threads, processes = threading.active_count(), []
    for _ in range(8):  # a thread or a process kept per hung call would show by the second
        eps = [Episode(make, {"prompt": "hi"}, TOK, limits, name="moody") for _ in range(3)]
        for ep in eps:
            ep.start_open()
        assert all(ep.finish_open() is not None for ep in eps)
        calls = [play(ep, text) for ep, text in zip(eps, ["hang", "ok", "bye"])]
        answers = [ep.respond(call) for ep, call in zip(eps, calls)]
        assert answers[0] is None and "CallTimeout: took longer than 0.25 s" in eps[0].error
        assert answers[1] and TOK.decode(answers[1]) == "\n[tool]OK<eos>\n[assistant]" and eps[2].done  # batch-mates
        assert eps[1].error is None and eps[2].error is None
        for ep in eps:
            ep.close()
        processes.append(make.pool.processes())
        # No thread waits on a call; each worker process has one thread writing its pipe, which ends
        # with it (a moment after it is killed).
        deadline = time.monotonic() + 5
        while threading.active_count() > threads + processes[-1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() <= threads + processes[-1]
    assert max(processes) <= 2  # the hung call's worker was killed once its episodes were done
    assert make.pool.started <= 2 + 8  # one replacement per hung call at most


def test_resets_and_worked_episodes_run_side_by_side_within_their_time_limits(moody):
    """Eight resets of 0.3 s take about 0.3 s, not 2.4; a worked turn that hangs fails each
    episode at its time limit, together, where one after the other they took 8 x (0.3 + limit)."""
    runner = EpisodeRunner(make_env=WorkerEnvironments(moody, workers=2), name="moody", tokenizer=TOK,
                           limits=EpisodeLimits(max_model_tokens=64, timeout_s=0.6))
    examples = [types.SimpleNamespace(fields={"reset_s": 0.3}, prompt_text=f"q{i}") for i in range(8)]
    stop = [TOK.eos_token_id]
    start = time.monotonic()
    played = worked_episodes(runner, examples, ["hang"], stop)
    assert time.monotonic() - start < 2.4
    assert all("worked turn" not in ep.error and "CallTimeout" in ep.error for ep in played)
    start = time.monotonic()
    played = worked_episodes(runner, examples, ["ok", "bye"], stop)
    assert time.monotonic() - start < 2.4 and [ep.error for ep in played] == [None] * 8
    assert all(ep.transcript[0]["env"] == "\n[tool]OK<eos>\n[assistant]" for ep in played)


def test_a_crashing_worker_fails_only_the_episodes_it_held(moody):
    make = WorkerEnvironments(moody, workers=2)
    eps = [Episode(make, {"prompt": "hi"}, TOK, EpisodeLimits(max_model_tokens=64, timeout_s=5.0)) for _ in range(2)]
    for ep in eps:  # the second reset finds the first worker busy: each episode has a worker of its own
        ep.start_open()
    for ep in eps:
        ep.finish_open()
    assert eps[0].respond(play(eps[0], "crash")) is None and "exit code 3" in eps[0].error
    assert eps[1].respond(play(eps[1], "ok")) is not None and eps[1].error is None
    assert make.pool.processes() == 1


def test_a_stop_signal_ends_the_wait_on_a_hanging_environment(moody):
    """SIGTERM while the trainer waits on a call that hangs: the call is given up at once (the
    episode fails, saying why), where it would have waited its 30 s."""
    ep = Episode(WorkerEnvironments(moody, workers=1), {"prompt": "hi"}, TOK, EpisodeLimits(timeout_s=30.0))
    lines = []
    with StopSignals(lines.append, stage="steps"):
        assert ep.open() is not None
        call = play(ep, "hang")
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        assert ep.respond(call) is None
        assert time.monotonic() - start < 3.0
    assert "CallStopped: given up: the run received SIGTERM" in ep.error, ep.error
    assert lines[0].startswith("received SIGTERM: finishing this step")
    ep.close()


def test_the_trainers_own_pool_stays_bounded_when_its_calls_hang():
    """Built-in environments run on the trainer's pool: a hanging call keeps its thread, which is
    never replaced, so 20 steps of hanging calls add at most the pool's threads; calls that find
    every thread held time out in the queue (and never run)."""
    pool, release, ran, started = LocalPool(threads=3), threading.Event(), [], []
    threads = threading.active_count()
    for step in range(20):
        hanging = [pool.start(release.wait) for _ in range(2)]
        started += hanging
        # Let the hanging calls take their threads first (on a loaded machine a thread may not have
        # picked its call up yet; one given up on in the queue would leave its thread free).
        deadline = time.monotonic() + 10
        while sum(c.running for c in started) < min(3, len(started)) and time.monotonic() < deadline:
            time.sleep(0.001)
        quick = pool.start(ran.append, step)
        for call in hanging + [quick] if step else hanging:
            with pytest.raises(TimeoutError):
                call.result(0.01)
        if step == 0:
            assert quick.result(5.0) is None  # a thread was free for it
        assert pool.threads <= 3 and threading.active_count() <= threads + 3
    release.set()
    assert pool.start(len, "abc").result(5.0) == 3
    assert ran == [0]  # the first step's third call found a thread; no later one ran after its time was up


def test_a_worker_that_stops_reading_never_blocks_the_trainer(moody):
    """A call holding a worker's GIL: it reads no more, its pipe fills, yet starting more calls on
    it (200 KB each) returns at once (they queue for the pipe's own thread), and each fails at its
    time limit; closing the pool kills the worker."""
    make = environment_maker(moody, {}, TOK, workers=1)
    limits = EpisodeLimits(max_model_tokens=64, max_env_tokens=64, timeout_s=0.5)
    eps = [Episode(make, {"prompt": "x"}, TOK, limits, name="moody") for _ in range(4)]
    for ep in eps:
        ep.start_open()
    for ep in eps:
        assert ep.finish_open() is not None, ep.error
    stuck = play(eps[0], "gil")
    time.sleep(0.2)  # the worker is in the regex now
    start = time.monotonic()
    calls = [play(ep, "y" * 200_000) for ep in eps[1:]]  # more than the pipe holds
    assert time.monotonic() - start < 5.0  # before, the third send waited for the worker: for good
    assert eps[0].respond(stuck) is None and "moody.step: CallTimeout" in eps[0].error
    for call in calls:
        with pytest.raises(TimeoutError):
            call.result(0.5)
    make.pool.close()
    assert make.pool.processes() == 0
