"""The compact header round's arithmetic, in process: fingerprints, the reduction
`combine` applies, and the verdict every rank reads from the reduced words.

The multi-rank side (every rank reaches the same verdict through MPI, rows
rounds only when asked) runs in `tests/programs/small_calls.py`.
"""

from __future__ import annotations

import numpy as np
import pytest

from asynclock._core.base.header import (
    C_FLAGS,
    C_FOLD,
    COMPACT_HEAD,
    COMPACT_WORDS,
    CONFLICT,
    FOLD_BOR,
    FOLD_NONE,
    FOLDS,
    NEED_ROWS,
    SLOT_WORDS,
    WORDS,
    Call,
    combine,
    compact_agreed,
    compact_words,
    fingerprint,
    fold_code,
    key_of_call,
    pack,
)
from asynclock._core.base.ops import DTYPE_CODES, ELEMENTWISE_OPS, Kind, ReduceOp

F32 = DTYPE_CODES["float32"]


def _words(call: Call, payload: np.ndarray | None = None, flags: int = 0,
           fold: int | None = None) -> np.ndarray:
    slot = np.zeros(SLOT_WORDS, np.int64)
    pack(call, slot)
    if payload is not None:
        raw = payload.view(np.uint8)
        slot.view(np.uint8)[WORDS * 8: WORDS * 8 + raw.size] = raw
    out = np.empty(COMPACT_WORDS, np.int64)
    compact_words(slot, FOLD_NONE if fold is None else fold, flags, out)
    return out


def _reduce(parts: list[np.ndarray]) -> np.ndarray:
    """What MPI computes for a non-commutative op: the rank-order fold (one grouping)."""
    acc = parts[0].copy()
    for part in parts[1:]:
        nxt = part.copy()
        combine(acc, nxt)
        acc = nxt
    return acc


def _allreduce(shape: tuple[int, ...], seq: int = 3, name: str = "") -> Call:
    return Call(Kind.ALLREDUCE, seq, op=int(ReduceOp.SUM), dtype=F32, shape=shape,
                nbytes=4 * int(np.prod(shape)), name=name)


def test_equal_calls_agree_and_fold_in_rank_order() -> None:
    xs = [np.array([1.5, -2.0], np.float32) * (r + 1) for r in range(3)]
    fold = fold_code(F32, ReduceOp.SUM)
    assert fold is not None
    reduced = _reduce([_words(_allreduce((2,)), x, fold=fold) for x in xs])
    assert compact_agreed(reduced, fold)
    got = reduced[COMPACT_HEAD:].view(np.float32)[:2]
    assert got.tobytes() == ((xs[0] + xs[1]) + xs[2]).tobytes()


@pytest.mark.parametrize("other", [
    _allreduce((3,)),  # a dim differs
    _allreduce((2,), seq=4),  # the sequence number differs
    _allreduce((2,), name="w"),  # one call is named
    Call(Kind.BROADCAST, 3, dtype=F32, shape=(2,), nbytes=8),  # another kind
    Call(Kind.ALLREDUCE, 3, op=int(ReduceOp.MAX), dtype=F32, shape=(2,), nbytes=8),
])
def test_any_difference_in_one_rank_shows_on_every_rank(other: Call) -> None:
    same = _words(_allreduce((2,)))
    for position in range(3):  # the odd rank first, in the middle, last
        parts = [same, same, same]
        parts[position] = _words(other)
        assert not compact_agreed(_reduce(parts), FOLD_NONE)


def test_a_rank_asking_for_rows_is_heard() -> None:
    same = _words(_allreduce((2,)))
    asking = _words(_allreduce((2,)), flags=NEED_ROWS)
    reduced = _reduce([same, asking, same])
    assert int(reduced[C_FLAGS]) == NEED_ROWS and not compact_agreed(reduced, FOLD_NONE)


def test_different_fold_codes_conflict() -> None:
    a = _words(_allreduce((2,)), fold=FOLDS[(F32, ReduceOp.SUM)])
    b = _words(_allreduce((2,)), fold=FOLDS[(F32, ReduceOp.MAX)])
    reduced = _reduce([a, b])
    assert int(reduced[C_FOLD]) == CONFLICT
    assert not compact_agreed(reduced, FOLDS[(F32, ReduceOp.SUM)])


def test_broadcast_payload_is_the_roots_bytes() -> None:
    call = Call(Kind.BROADCAST, 1, dtype=F32, root=1, shape=(3,), nbytes=12)
    root = np.array([np.nan, -0.0, 7.25], np.float32)
    parts = [_words(call, None if r != 1 else root, fold=FOLD_BOR) for r in range(3)]
    reduced = _reduce(parts)
    assert compact_agreed(reduced, FOLD_BOR)
    assert reduced[COMPACT_HEAD:].view(np.float32)[:3].tobytes() == root.tobytes()


def test_integer_folds_wrap_like_numpy() -> None:
    big = np.array([2**62, -(2**62)], np.int64)
    fold = FOLDS[(DTYPE_CODES["int64"], ReduceOp.SUM)]
    call = Call(Kind.ALLREDUCE, 1, op=int(ReduceOp.SUM), dtype=DTYPE_CODES["int64"],
                shape=(2,), nbytes=16)
    reduced = _reduce([_words(call, big, fold=fold)] * 3)
    with np.errstate(over="ignore"):
        want = big + big + big
    assert reduced[COMPACT_HEAD:COMPACT_HEAD + 2].tobytes() == want.tobytes()


def test_folds_cover_the_common_dtypes_and_not_half() -> None:
    for name in ("float32", "float64", "int32", "int64"):
        for op in ELEMENTWISE_OPS:
            assert fold_code(DTYPE_CODES[name], op) is not None, (name, op)
    assert fold_code(DTYPE_CODES["float16"], ReduceOp.SUM) is None  # rows round folds it
    assert fold_code(DTYPE_CODES["int8"], ReduceOp.SUM) is None


def test_fingerprint_separates_sequence_numbers_and_keys() -> None:
    key = key_of_call(np.array([0] * WORDS, np.int64))
    prints = {fingerprint(key, seq) for seq in range(10_000)}
    assert len(prints) == 10_000
    slot = np.zeros(WORDS, np.int64)
    pack(_allreduce((2,)), slot)
    other = np.zeros(WORDS, np.int64)
    pack(_allreduce((2,), seq=99), other)
    assert key_of_call(slot) == key_of_call(other)  # the key leaves the sequence number out
    assert fingerprint(key_of_call(slot), 3) != fingerprint(key_of_call(other), 99)
