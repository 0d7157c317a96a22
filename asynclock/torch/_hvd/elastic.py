"""`hvd.elastic`: Horovod's elastic API on asynclock.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, y) in enumerate(loader):     # DataLoader(sampler=state.sampler)
                ...; optimizer.step()
                state.sampler.record_batch(batch_idx, batch_size)
                if batch_idx % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)
    train(state)

Under `horovodrun --gloo --min-np N --max-np M [--host-discovery-script S]`. The
machinery (what a lost rank does, the new world, host updates) is the core's
(`asynclock._core.runtime.elastic`); this module adds what a torch job keeps:
models, optimizers and the sampler's place in the epoch, and what a reset does
to the gradient machinery (each `DistributedOptimizer` gets a new reducer on
the new world's gradient channel, with a plan for the new world size; train
steps of the async API are closed, and `coord.train_step` makes new ones).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data

from ..._core.base.errors import HostsUpdatedInterrupt
from ..._core.runtime import coordinator as runtime
from ..._core.runtime.elastic import ObjectState, State, run, use_reform_hooks
from .._grad.step import close_steps_of
from .optimizer import join_world, leave_world
from .params import broadcast_optimizer_state_async, broadcast_parameters_async
from .process_sets import forget_process_sets

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Shards a dataset over the ranks of the current world and remembers how far
    the epoch got, so that after a reset the samples not yet processed are split
    over the new world: none is lost and none is seen twice.

    Every rank takes every `size()`-th index of the epoch's order, which is
    Horovod's: `range(len(dataset))` shuffled by `random.Random(seed + epoch)`, the
    same on every rank, so a state dict (`epoch`, `processed_num`) saved under
    either library resumes at the same sample under the other, and the same script
    sees the same samples in the same order. `record_batch(batch_idx, batch_size)`
    after each batch counts `batch_size * size()` samples processed: those are a
    prefix of the epoch's order. Keep the sampler in a `TorchState`, and call
    `set_epoch(epoch + 1)` at an epoch's end.

    Unlike Horovod's sampler, no index is repeated to even out the shards: each
    rank's indices are those of Horovod's sampler, less the repeated one that ends
    some ranks' shards there. When the samples left do not split evenly, some
    ranks get one more; with a batch size that does not divide the shard, the last
    batch of those ranks is larger by one (or one batch more: keep the number of
    batches equal across ranks, e.g. with `drop_last`, or use `hvd.join()`).

    Args:
        dataset: the dataset; only its length is read.
        shuffle: shuffle each epoch as Horovod does (False: in order).
        seed: the shuffle's seed; the same on every rank.

    Raises:
        NotInitializedError: `hvd.init()` has not run (the shard needs the world).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (call it at the end of the previous one): nothing processed.

        Args:
            epoch: the epoch number; added to `seed` for the shuffle.
        """
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed a batch of `batch_size` samples.

        Args:
            batch_idx: the batch's index in the epoch (unused; Horovod's signature).
            batch_size: samples per batch on each rank.
        """
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """Where the epoch got, in Horovod's format.

        Returns:
            `{"epoch": ..., "processed_num": ...}`.
        """
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where `state` says, and shard what is left over the current world.

        Args:
            state: a `state_dict()` of this sampler or of Horovod's.
        """
        self.epoch, self.processed_num = int(state["epoch"]), int(state["processed_num"])
        self.reset()

    def epoch_order(self) -> list[int]:
        """Every index of the dataset in this epoch's order.

        Returns:
            `range(len(dataset))`, shuffled by `random.Random(seed + epoch)` where
            `shuffle` is set.
        """
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # Horovod's shuffle: `processed_num` counts a prefix of this order, so any
            # other order would make a state dict of Horovod's name other samples.
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Shard what is left of the epoch over the current world."""
        coord = runtime.coordinator()
        self.num_replicas, self.rank = coord.size, coord.rank
        left = self.epoch_order()[self.processed_num:]
        self.indices = left[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class _Kept:
    """One object of a `TorchState` with a state of its own (a model, an optimizer,
    a sampler): a copy of it at the last commit, restored and synced as a whole."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    async def sync(self, coord: runtime.Coordinator) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """The world changed (before the sync)."""


class _KeptModel(_Kept):
    async def sync(self, coord: runtime.Coordinator) -> None:
        await broadcast_parameters_async(coord, self.value.state_dict(), 0)


class _KeptOptimizer(_Kept):
    async def sync(self, coord: runtime.Coordinator) -> None:
        await broadcast_optimizer_state_async(coord, self.value, 0)


class _KeptSampler(_Kept):
    async def sync(self, coord: runtime.Coordinator) -> None:
        state = await coord.broadcast_object(self.value.state_dict(), root=0,
                                             name="asynclock.elastic.sampler")
        self.value.load_state_dict(state)

    def reset(self) -> None:
        self.value.reset()


# Synced in this order: an optimizer without state makes it with a local step on
# zero gradients, which weight decay turns into a change of the model, so the
# models come after the optimizers.
_KINDS: tuple[tuple[type[Any], type[_Kept]], ...] = (
    (torch.optim.Optimizer, _KeptOptimizer), (torch.nn.Module, _KeptModel),
    (ElasticSampler, _KeptSampler))


class TorchState(ObjectState):
    """`hvd.elastic.TorchState(model=..., optimizer=..., sampler=..., epoch=0, ...)`:
    models, optimizers and `ElasticSampler`s by their state dicts, any other value
    as in `ObjectState`. Each is an attribute; assigning a new model or optimizer
    to it commits that one at once, as in Horovod.

    A commit keeps deep copies, where Horovod's keeps references to the other
    values: a list or dict changed in place after a commit is rolled back by
    `restore()` here, and kept by Horovod's (which rolls back only what was
    assigned anew), so that after a lost rank the state is the last commit's.

    Args:
        model: a model, kept by its state dict and broadcast from rank 0 at a sync.
        optimizer: an optimizer, kept by its state dict and broadcast from rank 0.
        **values: more models, optimizers or `ElasticSampler`s (kept by their state
            dicts), or other values (kept as in `ObjectState`).
    """

    _kept: dict[str, _Kept]

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **values: Any) -> None:
        values.update(model=model, optimizer=optimizer)
        kept: dict[str, _Kept] = {}
        for kind, keeper in _KINDS:
            for name, value in values.items():
                if isinstance(value, kind) and name not in kept:
                    kept[name] = keeper(value)
        object.__setattr__(self, "_kept", kept)
        super().__init__(**{k: v for k, v in values.items() if k not in kept})
        for name, one in kept.items():
            object.__setattr__(self, name, one.value)

    def __setattr__(self, name: str, value: Any) -> None:
        kept: dict[str, _Kept] = self.__dict__.get("_kept", {})
        if name in kept:
            kept[name].value = value
            kept[name].save()
        super().__setattr__(name, value)

    def save(self) -> None:
        for one in self._kept.values():
            one.save()
        super().save()

    def restore(self) -> None:
        for one in self._kept.values():
            one.restore()
        super().restore()

    def reset(self) -> None:
        for one in self._kept.values():
            one.reset()

    async def sync_async(self) -> None:
        coord = runtime.coordinator()
        for one in self._kept.values():
            await one.sync(coord)
            one.save()  # rank 0's committed state is this rank's last commit now
        await super().sync_async()


def _leaving(old: runtime.Coordinator) -> None:
    close_steps_of(old)
    leave_world()


def _joined(new: runtime.Coordinator) -> None:
    forget_process_sets()
    join_world()


use_reform_hooks(_leaving, _joined)
