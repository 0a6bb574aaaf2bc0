"""IndexSampler: per-epoch permutations, determinism, resume == uninterrupted, process shards."""

from __future__ import annotations

import json

import pytest

from grpo_jax.data import IndexSampler


def test_each_epoch_is_a_new_permutation():
    sampler = IndexSampler(10, seed=0)
    epochs = [sampler.next(10) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(10))
        assert all(type(i) is int for i in order)
    assert len({tuple(order) for order in epochs}) == 4  # reshuffled every epoch
    assert sampler.state_dict()["epoch"] == 4 and sampler.state_dict()["position"] == 0
    assert IndexSampler(5, seed=0, shuffle=False).next(12) == [0, 1, 2, 3, 4] * 2 + [0, 1]


def test_deterministic_for_a_seed():
    assert IndexSampler(50, seed=7).next(120) == IndexSampler(50, seed=7).next(120)
    assert IndexSampler(50, seed=7).next(50) != IndexSampler(50, seed=8).next(50)
    # Batch boundaries do not change the order.
    split_reads = IndexSampler(50, seed=7)
    assert sum((split_reads.next(k) for k in (3, 0, 40, 17, 60)), []) == IndexSampler(50, seed=7).next(120)


@pytest.mark.parametrize("process_count", [1, 3])
def test_resumed_equals_uninterrupted(process_count):
    uninterrupted = IndexSampler(11, seed=3, process_index=process_count - 1, process_count=process_count)
    first = uninterrupted.next(7)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # checkpoints store plain values
    assert state["position"] > 0  # saved mid-epoch
    restored = IndexSampler(11, seed=3, process_index=process_count - 1, process_count=process_count)
    restored.load_state_dict(state)
    assert restored.next(25) == uninterrupted.next(25)  # crosses several epoch boundaries
    assert restored.state_dict() == uninterrupted.state_dict()
    assert len(first) == 7


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_shards_disjoint_and_cover_each_epoch(drop_remainder):
    n, p = 10, 3
    samplers = [
        IndexSampler(n, seed=5, process_index=i, process_count=p, drop_remainder=drop_remainder) for i in range(p)
    ]
    for _ in range(3):  # epochs
        shards = [s.next(s.epoch_size) for s in samplers]
        covered = [i for shard in shards for i in shard]
        assert len(covered) == len(set(covered))  # disjoint
        if drop_remainder:
            assert [len(shard) for shard in shards] == [3, 3, 3]  # equal epochs on every process
            assert set(covered) <= set(range(n)) and len(covered) == 9
        else:
            assert [len(shard) for shard in shards] == [4, 3, 3]
            assert sorted(covered) == list(range(n))
        assert {s.epoch for s in samplers} == {samplers[0].epoch}  # all processes crossed together
    # Dropped records change from epoch to epoch, so none is starved.
    dropped = set()
    for _ in range(20):
        seen = {i for s in samplers for i in s.next(s.epoch_size)}
        dropped |= set(range(n)) - seen
    assert len(dropped) > 1 if drop_remainder else dropped == set()


def test_state_from_another_sampler_refused():
    state = IndexSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        IndexSampler(10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="process_count"):
        IndexSampler(10, seed=1, process_count=2).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        IndexSampler(10, seed=1).load_state_dict({"epoch": 0})


def test_process_defaults_and_validation():
    sampler = IndexSampler(4, seed=0, process_index=None, process_count=None)  # read from jax
    assert (sampler.process_index, sampler.process_count) == (0, 1)
    with pytest.raises(ValueError, match="process_index"):
        IndexSampler(4, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="drop_remainder"):
        IndexSampler(2, seed=0, process_index=0, process_count=3)


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("n,count,block", [(23, 2, 4), (40, 4, 5), (9, 3, 1)])
def test_blocks_put_together_are_the_single_process_order(n, count, block, drop_remainder):
    """Process p's k-th read of `block` indices is block k*count + p of the one-process order, so
    the hosts' blocks side by side are exactly the batch one process would read."""
    single = IndexSampler(n, seed=7, drop_remainder=drop_remainder)
    hosts = [IndexSampler(n, seed=7, process_index=p, process_count=count, block=block,
                          drop_remainder=drop_remainder) for p in range(count)]
    order = single.epoch_indices(0)
    shards = [h.epoch_indices(0) for h in hosts]
    assert [len(s) for s in shards] == [h.epoch_size for h in hosts]
    assert sorted(i for s in shards for i in s) == (sorted(order[: n - n % (count * block)]) if drop_remainder
                                                    else sorted(order))
    for _ in range(n // (count * block)):  # the whole epoch (a one-process epoch drops less at its end)
        batch = [i for h in hosts for i in h.next(block)]
        assert batch == single.next(count * block)


def test_block_is_part_of_the_sampler_state():
    state = IndexSampler(20, seed=1, process_count=2, block=3).state_dict()
    with pytest.raises(ValueError, match="block"):
        IndexSampler(20, seed=1, process_count=2, block=4).load_state_dict(state)
    partial = {k: v for k, v in IndexSampler(20, seed=1).state_dict().items() if k != "block"}
    with pytest.raises(ValueError, match=r"lacks \['block'\]"):
        IndexSampler(20, seed=1).load_state_dict(partial)
