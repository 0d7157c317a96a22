"""In-process unit tests: headers, local arithmetic, input validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asynclock._core.base.errors import MismatchError, RemoteInputError
from asynclock._core.base.header import (
    PROCESS_GROUP,
    SLOT_WORDS,
    WORDS,
    Call,
    check,
    label,
    pack,
)
from asynclock._core.base.ops import DTYPE_CODES, Kind, ReduceOp, as_reduce_op
from asynclock._core.base.reduce import finish_average_inplace, fold, from_compute, to_compute
from asynclock._core.base.tensors import InputFault, InputRejected, as_buffer


def _rows(*calls: Call) -> np.ndarray:
    rows = np.zeros((len(calls), SLOT_WORDS), np.int64)
    for i, call in enumerate(calls):
        pack(call, rows[i])
    return rows[:, :WORDS]


def test_matching_headers_pass() -> None:
    a = Call(Kind.ALLREDUCE, 3, op=1, dtype=2, shape=(4, 5), nbytes=80, name="w")
    check(_rows(a, a, a), Kind.ALLREDUCE)


def test_shape_mismatch_names_every_rank() -> None:
    a = Call(Kind.ALLREDUCE, 3, op=1, dtype=2, shape=(4, 5), name="w")
    b = Call(Kind.ALLREDUCE, 3, op=1, dtype=2, shape=(4, 6), name="w")
    with pytest.raises(MismatchError) as err:
        check(_rows(a, b, a), Kind.ALLREDUCE)
    text = str(err.value)
    assert "ranks 0,2: #3 allreduce(sum) float32[4, 5] name='w'" in text
    assert "rank 1: #3 allreduce(sum) float32[4, 6] name='w'" in text


def test_allgather_allows_different_dim0_only() -> None:
    a = Call(Kind.ALLGATHER, 1, dtype=2, shape=(4, 5))
    check(_rows(a, Call(Kind.ALLGATHER, 1, dtype=2, shape=(9, 5))), Kind.ALLGATHER)
    with pytest.raises(MismatchError):
        check(_rows(a, Call(Kind.ALLGATHER, 1, dtype=2, shape=(4, 6))), Kind.ALLGATHER)


@pytest.mark.parametrize("kind", [Kind.ALLREDUCE, Kind.BROADCAST, Kind.ALLGATHER,
                                  Kind.REDUCE_SCATTER, Kind.ALLTOALL])
def test_ranks_on_different_transports_mismatch(kind: Kind) -> None:
    """One rank's data through the process group, another's over MPI: refused alike
    (each would wait on its own transport); the broadcast's root reads unflagged."""
    root = 1 if kind is Kind.BROADCAST else 0
    mpi = Call(kind, 2, op=1, dtype=2, root=root, shape=(70_000,), nbytes=280_000)
    group = mpi._replace(root=root | PROCESS_GROUP)
    check(_rows(group, group), kind)
    with pytest.raises(MismatchError) as err:
        check(_rows(group, mpi), kind)
    assert "float32[70000] via process group" in str(err.value), err.value
    assert "rank 1: #2 " in str(err.value) and "via" not in str(err.value).split("rank 1:")[1]
    if kind is Kind.BROADCAST:
        assert "(root=1) float32" in str(err.value), err.value


def test_sequence_mismatch_is_detected() -> None:
    with pytest.raises(MismatchError, match="#4"):
        check(_rows(Call(Kind.BARRIER, 4), Call(Kind.BARRIER, 5)), Kind.BARRIER)


def test_fault_is_reported_as_remote_input_error() -> None:
    ok = Call(Kind.ALLREDUCE, 1, op=1, dtype=2, shape=(3,))
    bad = Call(Kind.ALLREDUCE, 1, op=1, fault=int(InputFault.NON_CONTIGUOUS))
    with pytest.raises(RemoteInputError, match="rank 1: tensor is not contiguous"):
        check(_rows(ok, bad), Kind.ALLREDUCE)


def test_long_names_are_truncated_in_labels() -> None:
    rows = _rows(Call(Kind.BARRIER, 1, name="a-very-long-operation-name"))
    assert label(rows[0]) == "a-very-long-oper"


def test_bfloat16_round_trip_and_rounding() -> None:
    t = torch.tensor([1.0, 3.140625, -2.5, 65280.0, 1e-3], dtype=torch.bfloat16)
    raw = t.view(torch.int16).numpy().view(np.uint16)
    code = DTYPE_CODES["bfloat16"]
    out = np.empty_like(raw)
    from_compute(to_compute(raw, code), code, out)
    assert (out == raw).all()
    summed = np.empty_like(raw)
    fold(np.stack([raw, raw, raw]), code, ReduceOp.SUM, 3, summed)
    expect = (t.float() * 3).bfloat16()
    assert torch.equal(torch.from_numpy(summed.view(np.int16)).view(torch.bfloat16), expect)


def test_integer_average_rounds_toward_zero() -> None:
    """As Horovod's average (its join test observes it): -3 / 2 is -1, not -2."""
    out = np.empty(2, np.int64)
    fold(np.array([[1, -1], [2, -2]], np.int64), DTYPE_CODES["int64"], ReduceOp.AVERAGE, 2, out)
    assert out.tolist() == [1, -1]
    inplace = np.array([3, -3, 4, -4, 0], np.int32)
    finish_average_inplace(inplace, DTYPE_CODES["int32"], 2)
    assert inplace.tolist() == [1, -1, 2, -2, 0]


@pytest.mark.parametrize("bad, fault", [
    (torch.ones(3, 3).t(), InputFault.NON_CONTIGUOUS),
    (torch.ones(3, dtype=torch.complex64), InputFault.UNSUPPORTED_DTYPE),
    (torch.empty(3, device="meta"), InputFault.WRONG_DEVICE),
    ([1, 2], InputFault.NOT_A_TENSOR),
    (np.ones((3, 3))[:, 0], InputFault.NON_CONTIGUOUS),
])
def test_validation_faults(bad: object, fault: InputFault) -> None:
    with pytest.raises(InputRejected) as err:
        as_buffer(bad)
    assert err.value.fault is fault


def test_readonly_numpy_rejected_in_place_only() -> None:
    a = np.ones(3, np.float32)
    a.flags.writeable = False
    as_buffer(a)
    with pytest.raises(InputRejected):
        as_buffer(a, writable=True)


def test_reduce_op_aliases() -> None:
    assert as_reduce_op("mean") is ReduceOp.AVERAGE
    assert as_reduce_op(ReduceOp.MAX) is ReduceOp.MAX
    with pytest.raises(ValueError, match="unknown reduce op"):
        as_reduce_op("median")


def test_adasum_is_a_reduce_op_by_member_code_or_name() -> None:
    from asynclock._core.base.ops import Adasum, is_adasum

    for name in ("Adasum", "adasum", "ADASUM"):
        assert as_reduce_op(name) is ReduceOp.ADASUM is Adasum
        assert is_adasum(name)
    assert as_reduce_op(int(Adasum)) is Adasum and is_adasum(Adasum) and is_adasum(6)
    assert not any(is_adasum(op) for op in ("sum", ReduceOp.SUM, None, "median", 6.0))


def test_adasum_in_the_async_api_is_refused_on_every_rank_with_its_remedy() -> None:
    """No header carries Adasum: the async API's allreduce and reduce_scatter refuse it
    as bad input (the other ranks hear of it), naming `adasum()`, which computes it."""
    import anyio

    from asynclock._core.runtime.coordinator import Coordinator, make_backend

    async def main() -> None:
        coord = Coordinator(make_backend("local"))
        async with coord.running():
            for call in (coord.allreduce, coord.allreduce_):
                for op in (ReduceOp.ADASUM, "Adasum"):
                    with pytest.raises(InputRejected, match=r"adasum\(tensor\)"):
                        await call(np.ones(2, np.float32), op)
            with pytest.raises(InputRejected, match=r"adasum\(tensor\)"):
                await coord.reduce_scatter(np.ones(2, np.float32), "adasum")
            t = np.arange(4, dtype=np.float32)
            assert np.array_equal(await coord.adasum(t), t)  # one rank: its own tensor
            assert np.array_equal(await coord.allreduce(t, "sum"), t)  # the lane goes on
        coord.shutdown()

    anyio.run(main)


def test_ring_chunk_bounds_cover_every_element_once() -> None:
    from asynclock._core.transports.ring import chunk_bounds

    assert chunk_bounds(10, 3) == [0, 4, 7, 10]
    assert chunk_bounds(2, 3) == [0, 1, 2, 2]  # an empty chunk is fine
    for n, size in ((0, 2), (1, 1), (700_001, 7)):
        b = chunk_bounds(n, size)
        assert b[0] == 0 and b[-1] == n and len(b) == size + 1
        assert max(b[i + 1] - b[i] for i in range(size)) - min(
            b[i + 1] - b[i] for i in range(size)) <= 1


def test_wait_thread_holds_no_buffer_once_idle_and_is_joined() -> None:
    """Regression (CI: 'terminate called without an active exception' at exit): the
    wait thread kept its last op, so the last tensor could be freed by a daemon
    thread during interpreter shutdown. Idle, it must hold nothing; stopped, it
    must be gone."""
    import gc
    import threading
    import weakref

    import anyio

    from asynclock._core.runtime.coordinator import Coordinator, make_backend

    async def main() -> tuple[weakref.ref[torch.Tensor], int]:
        coord = Coordinator(make_backend("local"))
        async with coord.running():
            big = torch.ones(1 << 19)  # 2 MiB: a data stage for the wait thread
            await coord.allreduce_(big)
            assert coord.lowlevel.engine.statistics().thread_waits >= 1
            ref = weakref.ref(big)
            del big
            for _ in range(20):
                await anyio.sleep(0.005)
            gc.collect()
            alive = ref() is not None
        coord.shutdown()
        return ref, alive

    ref, alive_while_running = anyio.run(main)
    assert not alive_while_running, "the idle wait thread still references the last buffer"
    assert not [t for t in threading.enumerate() if t.name == "asynclock-wait"]


def test_process_set_ranks_are_checked_and_sorted() -> None:
    from asynclock._core.api.process_sets import Subset, normalise
    from asynclock._core.base.errors import InvalidInputError

    assert normalise([2, 0, 2], 3) == (0, 2)
    for bad in ([], [3], [-1, 0]):
        with pytest.raises(InvalidInputError, match="a process set needs ranks in 0..2"):
            normalise(bad, 3)
    outside = Subset((0, 2), 1, 7, None, None)
    assert (outside.size, outside.rank, outside.included) == (2, -1, False)
    with pytest.raises(InvalidInputError, match="rank 1 is not in process set"):
        outside.api  # noqa: B018
    with pytest.raises(InvalidInputError, match="root rank 1 is not in process set"):
        outside.set_rank(1)
    assert Subset((0, 2), 2, 7, None, None).set_rank(2) == 1


def test_header_text_for_a_rejected_op() -> None:
    """A rank that rejected its op sends op 0: the message still renders, once numbered."""
    rows = np.zeros((2, WORDS), np.int64)
    for r, (op, fault) in enumerate(((int(ReduceOp.SUM), 0), (0, int(InputFault.BAD_ARGUMENT)))):
        slot = np.zeros(SLOT_WORDS, np.int64)
        pack(Call(Kind.ALLREDUCE, 4, op=op, fault=fault), slot)
        rows[r] = slot[:WORDS]
    with pytest.raises(RemoteInputError,
                       match=r"^collective #4 allreduce\(\?\) rejected input on rank 1: invalid"):
        check(rows, Kind.ALLREDUCE)


# -- backend choice (`auto`) -------------------------------------------------------------
@pytest.mark.parametrize("env, want", [
    ({"HOROVOD_RANK": "0", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_HOSTNAME": "h"}, "horovod"),
    ({"HOROVOD_RANK": "0", "HOROVOD_CONTROLLER": "gloo", "PMI_SIZE": "2"}, "horovod"),
    ({"HOROVOD_RANK": "0", "HOROVOD_CONTROLLER": "mpi"}, "mpi"),
    ({"HOROVOD_HOSTNAME": "h", "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"PMI_SIZE": "2"}, "mpi"),
    ({}, "mpi"),
    ({"HOROVOD_RANK": "0", "HOROVOD_CONTROLLER": "gloo", "ASYNCLOCK_BACKEND": "mpi"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "ASYNCLOCK_BACKEND": "horovod"}, "horovod"),
])
def test_auto_picks_horovod_only_where_there_is_no_mpi_world(
        env: dict[str, str], want: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Horovod's background thread costs every rank a share of a core whether or not it
    has work, so `auto` takes Horovod only under `horovodrun --gloo` (no MPI world)."""
    from asynclock._core.runtime import coordinator as runtime

    for var in (*runtime._HOROVOD_ENV, *runtime._MPI_LAUNCHER_ENV, "ASYNCLOCK_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(runtime, "_horovod_importable", lambda: True)
    assert runtime.choose_backend("auto") == want
    assert runtime.choose_backend("local") == "local"  # an explicit choice stands


def test_a_stale_c_round_is_not_loaded_and_says_so(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A C round built from an older source runs the Python round, with a warning that
    says how to rebuild (a silent fallback would only show as a slower job)."""
    import os

    from asynclock._core.engine import fastpath

    built, source = tmp_path / "_fastpath_x.so", tmp_path / "_fastpath.c"
    built.write_bytes(b"")
    source.write_text("/* newer */")
    os.utime(built, (1_000_000, 1_000_000))
    monkeypatch.setattr(fastpath, "SOURCE", source)
    monkeypatch.setattr(fastpath, "built_path", lambda tag=None: built)
    with caplog.at_level("WARNING", logger="asynclock"):
        assert fastpath.load() is None
    assert "older than its source" in caplog.text and "build_fastpath" in caplog.text


def test_a_stage_failing_in_the_wait_thread_fails_its_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data stage that fails in the wait thread fails its op through `fail()`, as one
    that fails on the loop does (a gradient bucket's `on_done` hears of it there): the
    caller gets a BackendError that names the op, and the next collective works."""
    import anyio

    from asynclock._core.base.errors import BackendError
    from asynclock._core.runtime.coordinator import Coordinator, make_backend
    from asynclock._core.transports.base import Deferred
    from asynclock._core.transports.local import LocalChannel

    plain = LocalChannel.iallreduce
    armed = [True]  # the first bulk stage fails, the next one runs

    def lost(self: LocalChannel, send: Any, recv: Any, op: Any) -> Any:
        if recv.nbytes >= 1 << 20 and armed:
            armed.clear()

            def fail() -> None:
                raise RuntimeError("the peer is gone (on purpose)")
            return Deferred(fail)
        return plain(self, send, recv, op)

    monkeypatch.setattr(LocalChannel, "iallreduce", lost)

    async def main() -> None:
        coord = Coordinator(make_backend("local"))
        async with coord.running():
            big = torch.ones(1 << 19)  # 2 MiB: a data stage for the wait thread
            with pytest.raises(BackendError, match=r"allreduce .*the peer is gone"):
                await coord.allreduce_(big)
            await coord.allreduce_(big)
            assert coord.lowlevel.engine.statistics().thread_waits >= 2
        coord.shutdown()

    anyio.run(main)
