"""Sharding per epoch and seed (against torch's DistributedSampler), and join
semantics for uneven final batches on real ranks."""

from __future__ import annotations

import itertools

import pytest
from mpijob import assert_all_ok, run_job

from asynclock._tools.data import ShardSampler


@pytest.mark.parametrize(("n", "size"), [(10, 3), (12, 4), (2, 3), (7, 1), (100, 7)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_matches_torch_distributed_sampler(n: int, size: int, drop_last: bool,
                                           shuffle: bool) -> None:
    """Index for index, every rank and epoch: switching samplers keeps data order."""
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(n))
    for rank, epoch, seed in itertools.product(range(size), (0, 3), (0, 11)):
        ref = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
        ours = ShardSampler(n, rank=rank, size=size, shuffle=shuffle, seed=seed,
                            drop_last=drop_last)
        ref.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(ref) and len(ours) == len(ref), (rank, epoch, seed)


@pytest.mark.parametrize("generator", ["torch", "numpy"])
def test_shards_partition_each_epoch(generator: str) -> None:
    n, size = 50, 4
    epochs = []
    for epoch in range(3):
        shards = []
        for rank in range(size):
            s = ShardSampler(n, rank=rank, size=size, seed=1, generator=generator)
            s.set_epoch(epoch)
            shards.append(list(s))
        assert {len(x) for x in shards} == {13}  # padded to equal length
        assert set(itertools.chain(*shards)) == set(range(n))
        epochs.append(shards)
    assert epochs[0] != epochs[1] != epochs[2]
    again = ShardSampler(n, rank=2, size=size, seed=1, generator=generator)
    again.set_epoch(1)
    assert list(again) == epochs[1][2]  # deterministic from (seed, epoch) alone


def test_uneven_shards_and_batches() -> None:
    n, size = 10, 4
    shards = [ShardSampler(n, rank=r, size=size, even=False).indices() for r in range(size)]
    assert [len(s) for s in shards] == [3, 3, 2, 2]
    assert sorted(itertools.chain(*shards)) == list(range(n))
    s = ShardSampler(n, rank=0, size=1, shuffle=False, even=False)
    assert list(s.batches(4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(s.batches(4, drop_last=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank 3"):
        ShardSampler(5, rank=3, size=2)
    with pytest.raises(ValueError, match="generator"):
        ShardSampler(5, rank=0, size=2, generator="mt")


@pytest.mark.mpi
@pytest.mark.parametrize(("nranks", "loop"), [(2, "asyncio"), (3, "trio")])
def test_join_uneven_batches(nranks: int, loop: str) -> None:
    """Joined ranks answer sum/average/min/max with identities until all joined;
    `coord.join()` returns the last rank to join on every rank."""
    job = run_job("sync_join.py", nranks, *(["--trio"] if loop == "trio" else []),
                  timeout=180)
    assert_all_ok(job, nranks)
    for label in ("join_epoch0", "join_epoch1", "join_empty", "join_mismatch", "sampler"):
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"
    assert f"RANK 0 OK join_epoch0 {nranks - 1}" in job.output
