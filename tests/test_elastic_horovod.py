"""`hvd.elastic` beside Horovod 0.28's own, in one process: the `ElasticSampler`'s
indices and state dicts, and what `restore()` does to a value changed in place after
a commit.

Horovod's sampler takes its world from `rank()` and `size()`, names its module imports
from `horovod.torch.mpi_ops`; asynclock's takes it from the coordinator. Each test gives
both the rank and size it checks by patching those two lookups, and nothing else, so no
job of several ranks is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import asynclock
import asynclock.torch as hvd
from asynclock.torch._hvd import elastic as our_elastic

horovod_sampler = pytest.importorskip(
    "horovod.torch.elastic.sampler",
    reason="Horovod (horovod.torch) is not importable: there is no sampler to compare with")
horovod_state = pytest.importorskip(
    "horovod.torch.elastic.state",
    reason="Horovod (horovod.torch) is not importable: there is no state to compare with")

World = Callable[[int, int], None]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    """`world(rank, size)`: the world both samplers see from then on."""
    def put(rank: int, size: int) -> None:
        monkeypatch.setattr(horovod_sampler, "rank", lambda: rank)
        monkeypatch.setattr(horovod_sampler, "size", lambda: size)
        monkeypatch.setattr(our_elastic.runtime, "coordinator",
                            lambda: SimpleNamespace(rank=rank, size=size))
    return put


@pytest.fixture
def one_rank() -> Iterator[object]:
    coord = asynclock.init("local")
    yield coord
    asynclock.shutdown()


def same_shard(ours: Any, theirs: Any) -> list[int]:
    """Our rank's indices are Horovod's, less the one Horovod repeats at the end of a
    shard to even the shards out (it repeats the epoch's first samples left)."""
    mine, horovods = list(ours), list(theirs)
    left = theirs.remaining_indices
    assert len(ours) == len(mine) == len(range(theirs.rank, len(left), theirs.num_replicas))
    assert mine == horovods[:len(mine)], (mine, horovods)
    assert len(horovods) - len(mine) in (0, 1)
    assert set(horovods[len(mine):]) <= set(left[:theirs.total_size - len(left)])
    return mine


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_indices_are_horovods(world: World, shuffle: bool) -> None:
    for n_samples in (10, 17, 96):
        data = range(n_samples)
        for seed in (0, 1, 3, 1234):
            for epoch in (0, 1, 5):
                for size in (1, 2, 3, 4):
                    shards = []
                    for rank in range(size):
                        world(rank, size)
                        ours = hvd.elastic.ElasticSampler(data, shuffle=shuffle, seed=seed)
                        theirs = horovod_sampler.ElasticSampler(data, shuffle=shuffle,
                                                                seed=seed)
                        ours.set_epoch(epoch)
                        theirs.set_epoch(epoch)
                        assert ours.epoch_order() == theirs.remaining_indices
                        shards.append(same_shard(ours, theirs))
                        # a few batches recorded, then the processed ones dropped by a load
                        for batch_idx in range(2):
                            ours.record_batch(batch_idx, 3)
                            theirs.record_batch(batch_idx, 3)
                            assert ours.state_dict() == theirs.state_dict()
                            same_shard(ours, theirs)  # a record alone drops nothing
                        ours.load_state_dict(ours.state_dict())
                        theirs.load_state_dict(theirs.state_dict())
                        same_shard(ours, theirs)
                        # a place in the epoch not on a batch boundary
                        ours.load_state_dict({"epoch": epoch, "processed_num": 7})
                        theirs.load_state_dict({"epoch": epoch, "processed_num": 7})
                        same_shard(ours, theirs)
                    # every sample of the epoch once, as the shards partition it
                    assert sorted(i for shard in shards for i in shard) == list(data)


def test_a_state_dict_moves_between_horovod_and_asynclock(world: World) -> None:
    data, seed, batch = range(50), 7, 4
    for save_as, load_as in ((horovod_sampler, hvd.elastic), (hvd.elastic, horovod_sampler)):
        # 3 ranks, 2 batches into epoch 2: 24 samples processed
        world(1, 3)
        saved = save_as.ElasticSampler(data, seed=seed)
        saved.set_epoch(2)
        for batch_idx in range(2):
            saved.record_batch(batch_idx, batch)
        state = saved.state_dict()
        assert state == {"epoch": 2, "processed_num": 24}
        # the next world has 2 ranks: the 26 samples left split evenly
        for rank in range(2):
            world(rank, 2)
            loaded = load_as.ElasticSampler(data, seed=seed)
            loaded.load_state_dict(state)
            saved.load_state_dict(state)  # the saving library goes on by itself
            assert list(loaded) == list(saved) and len(list(loaded)) == 13
            assert loaded.state_dict() == saved.state_dict()
        # and the epoch after is the same too
        loaded.set_epoch(3)
        saved.set_epoch(3)
        assert list(loaded) == list(saved)


def test_restore_after_an_in_place_change_to_a_commit(one_rank: object) -> None:
    """A value assigned anew after a commit is rolled back by both; a list changed in
    place after a commit is rolled back by asynclock and kept by Horovod, whose commit
    keeps a reference to it (the deviation that docs/guide/horovod.md gives)."""
    theirs = horovod_state.TorchState(step=0, history=[1], untouched={"a": 1})
    # Horovod's commit is this save and a host check, which broadcasts (hvd.init first)
    theirs.save()
    ours = hvd.elastic.TorchState(step=0, history=[1], untouched={"a": 1})
    ours.commit()
    plain = hvd.elastic.ObjectState(step=0, history=[1], untouched={"a": 1})
    plain.commit()
    for state in (theirs, ours, plain):
        state.history.append(2)
        state.step = 5
        state.restore()
    assert theirs.step == ours.step == plain.step == 0
    assert theirs.untouched == ours.untouched == plain.untouched == {"a": 1}
    assert theirs.history == [1, 2]  # Horovod: the change in place stays
    assert ours.history == plain.history == [1]  # asynclock: the commit's list
