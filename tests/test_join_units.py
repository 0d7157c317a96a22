"""join(): the header verdicts every rank reaches, and the identity data."""

from __future__ import annotations

import numpy as np
import pytest

from asynclock._core.base.errors import JoinedError, MismatchError
from asynclock._core.base.header import EVERY_RANK, SLOT_WORDS, WORDS, Call, check, pack
from asynclock._core.base.ops import DTYPE_CODES, ELEMENTWISE_OPS, Kind, ReduceOp
from asynclock._core.base.reduce import to_compute
from asynclock._core.engine.join import JOIN_NAME, identity


def _rows(*calls: Call) -> np.ndarray:
    rows = np.zeros((len(calls), SLOT_WORDS), np.int64)
    for i, call in enumerate(calls):
        pack(call, rows[i])
    return rows[:, :WORDS]


def _joined(seq: int, mark: int = 0) -> Call:
    return Call(Kind.JOIN, seq, op=mark, name=JOIN_NAME)


ALLREDUCE = Call(Kind.ALLREDUCE, 7, op=int(ReduceOp.SUM), dtype=2, shape=(4,), nbytes=16,
                 name="loss")


def test_joined_ranks_stand_in_for_an_allreduce_and_a_barrier() -> None:
    rows = _rows(_joined(7), ALLREDUCE, _joined(7, 3), ALLREDUCE)
    for kind in (Kind.JOIN, Kind.ALLREDUCE):  # the same verdict, whoever checks
        assert check(rows, kind) == (0, 2)
    barrier = Call(Kind.BARRIER, 7, name="b")
    assert check(_rows(barrier, _joined(7)), Kind.BARRIER) == (1,)


def test_everyone_joined_is_not_a_stand_in() -> None:
    assert check(_rows(_joined(4, 10), _joined(4, 2)), Kind.JOIN) == ()


def test_other_kinds_are_refused_while_a_rank_has_joined() -> None:
    bcast = Call(Kind.BROADCAST, 7, dtype=2, root=1, shape=(3,), nbytes=12)
    with pytest.raises(JoinedError, match=r"^collective #7 broadcast\(root=1\) float32\[3\] "
                       r"cannot run while rank 0 has joined: a joined rank stands in only"):
        check(_rows(_joined(7), bcast, bcast), Kind.BROADCAST)


def test_rounds_that_need_every_rank_are_refused() -> None:
    shm = ALLREDUCE._replace(root=EVERY_RANK)
    with pytest.raises(JoinedError, match="ranks 0,2 have joined: it needs every rank's own "
                       "data .a shared-memory gradient round"):
        check(_rows(_joined(7), shm, _joined(7)), Kind.JOIN)


def test_the_others_must_still_agree_and_be_in_step() -> None:
    other = ALLREDUCE._replace(shape=(5,), nbytes=20)
    with pytest.raises(MismatchError, match=r"rank 0: #7 join name=.join.; rank 1: .*float32\[4\].*"
                       r"rank 2: .*float32\[5\]"):
        check(_rows(_joined(7), ALLREDUCE, other), Kind.ALLREDUCE)
    with pytest.raises(MismatchError, match="#8 join"):
        check(_rows(_joined(8), ALLREDUCE), Kind.ALLREDUCE)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8",
                                   "int32", "int64", "uint8"])
@pytest.mark.parametrize("op", ELEMENTWISE_OPS)
def test_identity_leaves_every_op_unchanged(dtype: str, op: ReduceOp) -> None:
    code = DTYPE_CODES[dtype]
    ident = to_compute(identity(code, op, 5), code)
    x = np.array([3, 1, 2, 7, 5], ident.dtype)
    combined = {ReduceOp.SUM: x + ident, ReduceOp.AVERAGE: x + ident,
                ReduceOp.MIN: np.minimum(x, ident), ReduceOp.MAX: np.maximum(x, ident),
                ReduceOp.PRODUCT: x * ident}[op]
    assert np.array_equal(combined, x), (dtype, op, ident)
