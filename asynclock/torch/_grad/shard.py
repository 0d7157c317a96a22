"""Sharded optimizer: parameters and optimizer state once per node, each rank
updating only the chunk of every bucket it reduces.

Why: in plain data parallelism every rank runs the same optimizer step over
the same averaged gradients, so a node does that memory-bound work once per
rank, and with shared-memory reduction every rank also stores the chunks
it summed into every other rank's buffer. For a memory-bound model the optimizer step is a
large share of the training step (benchmarks page). Here rank r, which already sums chunk r
of every bucket over all ranks (`shm_pipeline`), applies the optimizer to
that chunk at once, writing parameters and state that live once per node
in a shared window: nothing is copied back, and each element is updated by
exactly one rank, so ranks cannot drift apart. (ZeRO stage 1 and torch's
ZeroRedundancyOptimizer shard state the same way; parameters live in one
copy here because the ranks share memory.)

Only elementwise optimizers qualify: updating a slice of a parameter from the
same slice of its gradient and state must give what the whole update gives
(SGD, Adam, ...; not LBFGS, or anything with per-tensor norms). In float32 it
gives the same bits; for bfloat16, torch's kernels round a slice's vector tail
differently (by an ulp in the cases tested), and the ranks agree all the same.

Round 1 runs unsharded: it is the profiling round, reduced by MPI allreduce
on the guessed plan. Every rank then holds the same parameters and state
(the same averaged gradients, the same step), `Shards.switch` moves node
rank 0's copy into the window, and the plan never changes again.

Optimizer state in the window has the parameter's shape ("full" keys, e.g.
`momentum_buffer`), so any rank can read all of it for a checkpoint without
asking the others: the user's optimizer keeps views of it as its state, and
its own `state_dict()` works unchanged. Scalar state (`step`) is kept per
piece, also in the window, because every piece steps it once per round; the
user's optimizer sees the piece that starts the parameter, and loading a
state dict (a post-hook) writes every piece.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._core.transports.shared_window import allocate
from .apply import hyperparameters
from .buckets import Plan
from .registry import ParamRegistry
from .shm_chunks import chunk

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adadelta)


# -- where sharded state lives: pieces of buckets, and the node window's layout --------
# A piece is one parameter's share of one rank's chunk of one bucket: the unit a rank
# updates. Every rank computes the same list from the agreed plan, so the window's
# layout (parameters, whole-shape state, one scalar slot per piece and key) is the same
# everywhere without being sent.

SCALAR_KEYS = frozenset({"step", "mu_product"})
# handed instead of a round's settings when its step() never came (`hand_skip`)
SKIP_UPDATE: list[dict[str, Any]] = []
ALIGN, SCALAR_BYTES = 64, 8


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, stop) of parameter `param`, at [lo, hi) of its group buffer;
    `rank` (node rank) reduces and updates it as part of bucket `bucket`."""

    param: int
    start: int
    stop: int
    lo: int
    hi: int
    rank: int
    bucket: int


def pieces(plan: Plan, n: int) -> list[Piece]:
    """Every rank's pieces, in a fixed order (the same list on every rank)."""
    out = []
    for b in plan.buckets:
        for q in range(n):
            lo, hi = chunk(b, q, n)
            for s in b.segments:
                a, z = max(s.offset, lo), min(s.offset + s.numel, hi)
                if a < z:
                    start = s.start + a - s.offset
                    out.append(Piece(s.param, start, start + z - a, a, z, q, b.index))
    return out


@dataclass(frozen=True, slots=True)
class StateKeys:
    """One parameter's optimizer state, split by where it lives."""

    full: dict[str, torch.dtype]  # the parameter's shape: one slot in the window
    scalar: dict[str, torch.dtype]  # per piece, in the window
    plain: dict[str, Any]  # not a tensor (e.g. a None buffer): copied into each piece


def split_state(p: torch.Tensor, state: dict[str, Any]) -> StateKeys:
    keys = StateKeys({}, {}, {})
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            keys.plain[key] = value
        elif key in SCALAR_KEYS and value.numel() == 1:
            keys.scalar[key] = value.dtype
        elif value.shape == p.shape:
            keys.full[key] = value.dtype
        else:
            raise ValueError(f"shard_optimizer: cannot shard optimizer state {key!r} of shape "
                             f"{tuple(value.shape)} for a parameter of shape {tuple(p.shape)}")
    return keys


class Layout:
    """Byte offsets in the node's window: parameters, full state, scalar slots."""

    def __init__(self, params: Sequence[torch.Tensor], keys: list[StateKeys],
                 all_pieces: list[Piece]) -> None:
        self.total = 0
        self.param_at = [self._take(p.numel() * p.element_size()) for p in params]
        self.full_at = {(i, key): self._take(params[i].numel() * size_of(dtype))
                        for i, k in enumerate(keys) for key, dtype in k.full.items()}
        self.scalar_at = {(j, key): self._take(SCALAR_BYTES)
                          for j, piece in enumerate(all_pieces)
                          for key in keys[piece.param].scalar}

    def _take(self, nbytes: int) -> int:
        at = self.total
        self.total += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return at


def size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_shardable(optimizer: torch.optim.Optimizer, *, compressed: bool,
                    process_set: Any, groups: Any) -> None:
    """Refuse, on every rank alike, what sharding cannot do exactly."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(f"shard_optimizer=True needs an elementwise optimizer ({names}), "
                         f"not {type(optimizer).__name__}: each rank updates slices of "
                         "parameters, which is exact only when no update looks across elements")
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if devices - {"cpu"}:
        raise ValueError("shard_optimizer=True keeps the parameters in host memory shared "
                         f"by the node's ranks: CPU parameters only, not {sorted(devices)}")
    if compressed:
        raise ValueError("shard_optimizer=True reduces in the parameters' own dtype: "
                         "drop gradient compression")
    if process_set is not None or groups:
        raise ValueError("shard_optimizer=True shards over every rank of the node: "
                         "process sets and Horovod groups are not supported with it")


def refuse_unsharded(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is not available with shard_optimizer=True: each rank updates only its "
        "own pieces (use optimizer.synchronize(), then step() inside skip_synchronize(), "
        "to work on the whole averaged gradient first, e.g. to clip it)")


class SyncRequest:
    """A sharded `synchronize()`: done once `.grad` holds the whole average on every
    rank (the pipeline copied the others' chunks back), or the round failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def set(self) -> None:
        self.done.set()


def _constructor_defaults(cls: type[torch.optim.Optimizer],
                          defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the class's constructor takes by name (some, like AdamW's
    `decoupled_weight_decay`, are set by the class itself); groups carry the rest."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted}


class Shards:
    """The node's window and this rank's share of the optimizer (one per bucket)."""

    def __init__(self, node: Any, optimizer: torch.optim.Optimizer,
                 base: type[torch.optim.Optimizer], registry: ParamRegistry, plan: Plan,
                 flat: dict[str, torch.Tensor]) -> None:
        self.registry, self.plan, self.base = registry, plan, base
        self.me, self.n = node.Get_rank(), node.Get_size()
        self.optimizer = optimizer  # the user's: hyperparameters are read from its groups
        params = registry.params
        self.keys = [split_state(p, optimizer.state.get(p, {})) for p in params]
        self.pieces = pieces(plan, self.n)
        self._first = {p.param: j for j, p in enumerate(self.pieces) if p.start == 0}
        self.layout = Layout(params, self.keys, self.pieces)
        self._window(node)
        self._group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                          for p in group["params"]}
        self.inner: dict[int, tuple[torch.optim.Optimizer, list[int]]] = {}
        self.active = False  # parameters and state live in the window
        self._flat = flat
        self._hypers: deque[list[dict[str, Any]]] = deque()  # handed by step(), one a round
        self._syncs: dict[int, SyncRequest] = {}  # by the reducer's round number

    # -- the switch ------------------------------------------------------------------
    def _window(self, node: Any) -> None:
        total = self.layout.total if self.me == 0 else 0
        self.win = allocate(total, node)  # locked for its life, as `Win_sync` needs
        memory = self.win.Shared_query(0)[0]
        self.base_bytes = torch.frombuffer(memory, dtype=torch.uint8, count=self.layout.total)
        self._node = node

    def _bytes(self, at: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.base_bytes[at: at + numel * size_of(dtype)].view(dtype)

    def param(self, i: int) -> torch.Tensor:
        p = self.registry.params[i]
        return self._bytes(self.layout.param_at[i], p.dtype, p.numel()).view(p.shape)

    def full(self, i: int, key: str) -> torch.Tensor:
        p = self.registry.params[i]
        dtype = self.keys[i].full[key]
        return self._bytes(self.layout.full_at[(i, key)], dtype, p.numel()).view(p.shape)

    def scalar(self, j: int, key: str) -> torch.Tensor:
        """Piece j's scalar `key`: a 0-dim tensor in the window."""
        dtype = self.keys[self.pieces[j].param].scalar[key]
        return self.base_bytes[self.layout.scalar_at[(j, key)]:][:SCALAR_BYTES].view(dtype)[0]

    def switch(self) -> None:
        """Node rank 0 copies parameters and state in; then every rank's parameters
        become views of the window and its optimizer keeps state for its pieces only."""
        if self.me == 0:
            self._fill_window()
        self.win.Sync()
        self._node.Barrier()
        self.win.Sync()
        for i, p in enumerate(self.registry.params):
            p.data = self.param(i)
        self._build_inner()
        self.active = True
        self.attach()
        self._hook = self.optimizer.register_load_state_dict_post_hook(self._loaded)

    def attach(self) -> None:
        """The user's optimizer sees the window as its state (whole parameters; scalars
        of each parameter's first piece): its private copies are dropped."""
        for i, p in enumerate(self.registry.params):
            views = self._views(i)
            if views:
                self.optimizer.state[p] = views

    def _views(self, i: int) -> dict[str, Any]:
        keys = self.keys[i]
        state: dict[str, Any] = dict(keys.plain)
        state.update({key: self.full(i, key) for key in keys.full})
        state.update({key: self.scalar(self._first[i], key) for key in keys.scalar})
        return state

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After `load_state_dict` replaced the state with private tensors: write them
        into the window (every piece) and show the window again."""
        if self.active:
            self.load(optimizer.state)
            self.attach()

    def unshare(self) -> None:
        """Private copies of parameters and state again (shutdown, or the train step
        closed), so the model and optimizer work without the window."""
        if not self.active:
            return
        self.active = False
        self._hook.remove()
        for p, state in self.gathered_state().items():
            self.optimizer.state[p] = state
        for p in self.registry.params:
            p.data = p.data.clone()

    def _fill_window(self) -> None:
        state = self.optimizer.state
        for i, p in enumerate(self.registry.params):
            self.param(i).copy_(p.detach())
            for key in self.keys[i].full:
                self.full(i, key).copy_(state[p][key])
        for j, piece in enumerate(self.pieces):
            for key in self.keys[piece.param].scalar:
                self.scalar(j, key).copy_(state[self.registry.params[piece.param]][key])

    def _build_inner(self) -> None:
        mine: dict[int, list[int]] = defaultdict(list)
        for j, piece in enumerate(self.pieces):
            if piece.rank == self.me:
                mine[piece.bucket].append(j)
        for k, js in mine.items():
            self.inner[k] = self._inner_for(js)

    def _inner_for(self, js: list[int]) -> tuple[torch.optim.Optimizer, list[int]]:
        """An optimizer of the user's class over pieces js, grouped like the user's groups."""
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        states: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for j in js:
            sub, state = self._piece_tensor(j)
            by_group[self._group_of[id(self.registry.params[self.pieces[j].param])]].append(sub)
            states.append((sub, state))
        order = sorted(by_group)
        now = hyperparameters(self.optimizer)
        groups = [dict(now[g], params=by_group[g]) for g in order]
        inner = self.base(groups, **_constructor_defaults(self.base, self.optimizer.defaults))
        for sub, state in states:
            inner.state[sub] = state
        return inner, order

    def _piece_tensor(self, j: int) -> tuple[torch.Tensor, dict[str, Any]]:
        piece = self.pieces[j]
        i, keys = piece.param, self.keys[piece.param]
        sub = self.param(i).view(-1)[piece.start: piece.stop]
        group = self.plan.buckets[piece.bucket].group
        sub.grad = self._flat[group][piece.lo: piece.hi]
        state: dict[str, Any] = dict(keys.plain)
        state.update({key: self.full(i, key).view(-1)[piece.start: piece.stop]
                      for key in keys.full})
        state.update({key: self.scalar(j, key) for key in keys.scalar})
        return sub, state

    # -- every round ----------------------------------------------------------------
    def hand_hyper(self) -> None:
        """`step()` of a round (user's thread): its hyperparameters as they are now, so
        LR schedulers and `param_groups` edits before `step()` take effect exactly as
        unsharded, whenever the pipeline gets to the buckets."""
        self._hypers.append(hyperparameters(self.optimizer))

    def hand_skip(self) -> None:
        """A synchronized round whose `step()` never came (GradScaler skips it where it
        finds inf or NaN): the pipeline finishes it without an update, as a skipped
        unsharded step leaves the parameters and the state."""
        self._hypers.append(SKIP_UPDATE)

    def request_sync(self, number: int) -> SyncRequest:
        """`synchronize()` of round `number` (before its step()): asked of the pipeline."""
        request = self._syncs[number] = SyncRequest()
        return request

    def sync_request(self, number: int) -> SyncRequest | None:
        return self._syncs.get(number)

    def forget_sync(self, number: int) -> None:
        self._syncs.pop(number, None)

    def fail_sync(self, number: int, error: BaseException) -> None:
        request = self._syncs.get(number)
        if request is not None:
            request.error = error
            request.set()

    def take_hyper(self) -> list[dict[str, Any]] | None:
        """The oldest round's hyperparameters (pipeline thread), None until handed."""
        return self._hypers.popleft() if self._hypers else None

    def step_bucket(self, k: int, hyper: list[dict[str, Any]]) -> None:
        """Update this rank's pieces of bucket k (its reduced chunk is in place)."""
        entry = self.inner.get(k)
        if entry is None or hyper is SKIP_UPDATE:
            return
        inner, order = entry
        for group, g in zip(inner.param_groups, order, strict=True):
            group.update(hyper[g])
        inner.step()

    # -- checkpoints -------------------------------------------------------------------
    def gathered_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Every parameter's whole state, copied out of the window."""
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for i, p in enumerate(self.registry.params):
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in self._views(i).items()}
            if state:
                out[p] = state
        return out

    def load(self, state: dict[Any, dict[str, Any]]) -> None:
        """Write loaded state into the window: whole parameters and every piece's
        scalars, so loading on one rank alone updates the node's one copy."""
        for i, p in enumerate(self.registry.params):
            loaded = state.get(p, {})
            for key in self.keys[i].full:
                if key in loaded:
                    self.full(i, key).copy_(loaded[key])
        for j, piece in enumerate(self.pieces):
            loaded = state.get(self.registry.params[piece.param], {})
            for key in self.keys[piece.param].scalar:
                if key in loaded:
                    self.scalar(j, key).copy_(loaded[key])
