"""The fixed-size header every checked collective exchanges first.

Each rank describes its call in one slot of `SLOT_BYTES`: 18 int64 words
(kind, sequence number, op, dtype, shape, root, name, local input fault)
followed by up to `INLINE_BYTES` of payload. Because the slot size never
depends on the call, ranks that disagree still complete the round, see
every rank's description, and raise the same `MismatchError`; no transport
ever sees a mismatched buffer. Small payloads ride inline, so small
collectives cost one round trip in total.

Two rounds carry it:

* the rows round: an allgather of every rank's slot (`SLOT_BYTES` x N);
* the compact round, where the channel has one (MPI): an allreduce of
  `COMPACT_BYTES` whatever N is. Each rank sends a 64-bit fingerprint of
  its header words and its complement, flags, a fold code and the inline
  payload; the reduction ORs the first three words and folds the payloads
  in rank order (`combine`). Every rank's fingerprint is equal exactly when
  (OR fp) & (OR ~fp) == 0, so the reduced words tell every rank the same
  verdict. A rank that needs every rank's words (a fault to report, a call
  whose data depends on every rank's dims, a joined rank, a lane matching by
  name) sets `NEED_ROWS`; then, and whenever the fingerprints differ, every
  rank runs the rows round next, and the error names every rank's call as
  before. Steady state costs one constant-size reduction per call.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from typing import Any, NamedTuple

import numpy as np

from .errors import JoinedError, MismatchError, RemoteInputError
from .ops import DTYPE_CODES, DTYPE_NAMES, NUMPY_OF_CODE, Kind, ReduceOp
from .tensors import FAULT_TEXT, InputFault

WORDS = 18
HEADER_BYTES = WORDS * 8
INLINE_BYTES = 128
SLOT_BYTES = HEADER_BYTES + INLINE_BYTES
SLOT_WORDS = SLOT_BYTES // 8
MAGIC = 0x41534C4B0001  # "ASLK" + format version

(W_MAGIC, W_SEQ, W_KIND, W_OP, W_DTYPE, W_ROOT, W_NAME, W_FAULT, W_NBYTES, W_DIM0,
 W_NDIM, W_TAIL, W_D1, W_D2, W_D3, W_D4, W_LABEL, W_LABEL2) = range(WORDS)

# W_ROOT flag of an allreduce or barrier that a joined rank cannot stand in for
EVERY_RANK = 1
STAND_IN = frozenset({Kind.ALLREDUCE, Kind.BARRIER})
# W_ROOT flag (above any root): the call's data goes through the channel's process
# group (`engine.device_pg`), not MPI. Matched, so ranks that chose different
# transports fail alike instead of each waiting on its own; a joined rank reads it
# to stand in on the live ranks' transport.
PROCESS_GROUP = 1 << 32
ROOT_MASK = PROCESS_GROUP - 1

_COMMON = (W_MAGIC, W_SEQ, W_KIND, W_NAME)
_MATCH: dict[Kind, tuple[int, ...]] = {
    Kind.ALLREDUCE: _COMMON + (W_OP, W_DTYPE, W_ROOT, W_DIM0, W_NDIM, W_TAIL),
    Kind.BROADCAST: _COMMON + (W_DTYPE, W_ROOT, W_DIM0, W_NDIM, W_TAIL),
    Kind.ALLGATHER: _COMMON + (W_DTYPE, W_ROOT, W_NDIM, W_TAIL),
    Kind.REDUCE_SCATTER: _COMMON + (W_OP, W_DTYPE, W_ROOT, W_DIM0, W_NDIM, W_TAIL),
    Kind.ALLTOALL: _COMMON + (W_DTYPE, W_ROOT, W_NDIM, W_TAIL),
    Kind.BARRIER: _COMMON,
    Kind.BROADCAST_OBJECT: _COMMON + (W_ROOT,),
    Kind.ALLGATHER_OBJECT: _COMMON,
    Kind.AGREE: _COMMON + (W_OP, W_DTYPE, W_DIM0),
    Kind.JOIN: _COMMON,  # W_OP: the rank's join mark (see `engine.join`)
    Kind.FILLER: _COMMON,  # W_OP: `engine.matching` flags
    Kind.MAKE: _COMMON + (W_DIM0, W_NDIM, W_TAIL),  # the shape: the ranks it is for
}


class Call(NamedTuple):
    """What one rank says it is doing; packed into its header slot.

    A NamedTuple rather than a frozen dataclass: it is built on every call
    and a tuple is several times cheaper to construct.
    """

    kind: Kind
    seq: int
    op: int = 0
    dtype: int = 0
    root: int = 0
    name: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    fault: int = 0


_LAYOUT = struct.Struct(f"<{WORDS}q")


def name_hash(name: str) -> int:
    """Stable across processes (str.__hash__ is salted per process); never 0 for a
    name, so W_NAME alone tells a named call from an unnamed one."""
    return (zlib.crc32(name.encode()) | 1 << 32) if name else 0


@functools.lru_cache(maxsize=4096)
def _name_words(name: str) -> tuple[int, int, int]:
    """crc32 plus the first 16 bytes of the name, so every rank can print every
    rank's name; cached because training loops reuse a few names forever."""
    raw = name.encode()[:16].ljust(16, b"\0")
    return (name_hash(name), int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True))


@functools.lru_cache(maxsize=4096)
def _shape_words(shape: tuple[int, ...]) -> tuple[int, ...]:
    """dim0, ndim, hash of the trailing dims, and dims 1-4 (cached per shape)."""
    dims = list(shape[1:5]) + [0] * (4 - len(shape[1:5]))
    return (shape[0] if shape else 1, len(shape), hash(shape[1:]), *dims)


def pack(call: Call, slot: Any) -> None:
    """Write `call` into the first `WORDS` words of a send slot."""
    crc, label1, label2 = _name_words(call.name)
    _LAYOUT.pack_into(slot, 0, MAGIC, call.seq, int(call.kind), call.op, call.dtype, call.root,
                      crc, call.fault, call.nbytes, *_shape_words(call.shape), label1, label2)


def label(row: np.ndarray[Any, Any]) -> str:
    """Decode the name label of one header row."""
    raw = int(row[W_LABEL]).to_bytes(8, "little", signed=True)
    raw += int(row[W_LABEL2]).to_bytes(8, "little", signed=True)
    return raw.rstrip(b"\0").decode(errors="replace")


def agree(recv: np.ndarray[Any, Any], size: int) -> bool:
    """Fast path: every rank's header words are byte-identical (one memcmp each)."""
    raw = recv.tobytes()
    first = raw[:HEADER_BYTES]
    return all(raw[r * SLOT_BYTES: r * SLOT_BYTES + HEADER_BYTES] == first for r in range(1, size))


def joining(rows: np.ndarray[Any, Any]) -> bool:
    """Some rank's header is a joined rank's stand-in round (`engine.join`)."""
    return bool((rows[:, W_KIND] == int(Kind.JOIN)).any())


def check(rows: np.ndarray[Any, Any], kind: Kind) -> tuple[int, ...]:
    """Raise the same error on every rank unless all headers agree.

    Returns the ranks that joined (`Kind.JOIN`) and stand in for this call,
    usually none: the verdict depends on the rows alone, so every rank,
    joined or not, reaches the same one.
    """
    faults = np.flatnonzero(rows[:, W_FAULT])
    if faults.size:
        raise RemoteInputError(_fault_text(rows, faults))
    joined = rows[:, W_KIND] == int(Kind.JOIN)
    if joined.any() and not joined.all():
        return _stand_ins(rows, joined)
    _compare(rows, rows, kind)
    return ()


def _compare(rows: np.ndarray[Any, Any], every: np.ndarray[Any, Any], kind: Kind) -> None:
    """`rows` agree on what `kind` must match; the error text names `every` row."""
    sub = rows[:, _MATCH[kind]]
    if not (sub == sub[0]).all():
        raise MismatchError(mismatch_text(every))


def _stand_ins(rows: np.ndarray[Any, Any], joined: np.ndarray[Any, Any]) -> tuple[int, ...]:
    """Some ranks joined: the rest agree among themselves, in step with the joined
    ranks, on a call a joined rank can stand in for (identity data)."""
    if (rows[:, W_MAGIC] != MAGIC).any() or (rows[:, W_SEQ] != rows[0, W_SEQ]).any():
        raise MismatchError(mismatch_text(rows))
    active = rows[~joined]
    kind = Kind(int(active[0, W_KIND]))
    _compare(active, rows, kind)
    ranks = tuple(int(r) for r in np.flatnonzero(joined))
    if kind in STAND_IN and not int(active[0, W_ROOT]) & EVERY_RANK:
        return ranks
    who = _ranks(list(ranks)) + (" has" if len(ranks) == 1 else " have")
    why = ("it needs every rank's own data (a shared-memory gradient round)"
           if kind in STAND_IN else "a joined rank stands in only for allreduce and barrier")
    raise JoinedError(f"collective {describe_row(active[0])} cannot run while {who} joined: {why}")


def _fault_text(rows: np.ndarray[Any, Any], ranks: np.ndarray[Any, Any]) -> str:
    """Name each rank that rejected its input and why."""
    parts = [f"rank {r}: {FAULT_TEXT.get(InputFault(int(rows[r, W_FAULT])), 'invalid input')}"
             for r in ranks]
    first = rows[int(ranks[0])]
    head = f"collective {describe_row(first)} rejected input on "  # "#4 allreduce(sum) ..."
    return head + "; ".join(parts)


def mismatch_text(rows: np.ndarray[Any, Any]) -> str:
    """Group ranks by what they called; identical text on every rank."""
    groups: dict[str, list[int]] = {}
    for r in range(rows.shape[0]):
        groups.setdefault(describe_row(rows[r]), []).append(r)
    body = "; ".join(f"{_ranks(rs)}: {desc}" for desc, rs in groups.items())
    return f"mismatched collective across ranks: {body}"


_OP_CODES = frozenset(int(op) for op in ReduceOp)
_DATA_KINDS = frozenset({Kind.ALLREDUCE, Kind.BROADCAST, Kind.ALLGATHER, Kind.REDUCE_SCATTER,
                         Kind.ALLTOALL})


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(map(str, rs))


def describe_row(row: np.ndarray[Any, Any]) -> str:
    """Human text of one header: `#3 allreduce(sum) float32[4, 3] name='w'`."""
    if int(row[W_MAGIC]) != MAGIC:
        return "<not an asynclock header>"
    kind = Kind(int(row[W_KIND]))
    text = f"#{int(row[W_SEQ])} {kind.name.lower()}"
    if kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER):
        op = int(row[W_OP])  # 0 in the header of a rank that rejected its op
        text += f"({ReduceOp(op).name.lower() if op in _OP_CODES else '?'})"
    if kind in (Kind.BROADCAST, Kind.BROADCAST_OBJECT):
        text += f"(root={int(row[W_ROOT]) & ROOT_MASK})"
    if int(row[W_DTYPE]):
        text += f" {DTYPE_NAMES[int(row[W_DTYPE])]}{_shape_text(row)}"
    if kind in _DATA_KINDS and int(row[W_ROOT]) & PROCESS_GROUP:
        text += " via process group"
    elif kind is Kind.MAKE and int(row[W_NDIM]):
        text += f" for ranks {_shape_text(row)}"
    name = label(row)
    return text + (f" name={name!r}" if name else "")


def _shape_text(row: np.ndarray[Any, Any]) -> str:
    ndim = int(row[W_NDIM])
    dims = [int(row[W_DIM0])] + [int(d) for d in row[W_D1:W_D1 + min(ndim - 1, 4)]]
    return str(dims[:ndim]) if ndim <= 5 else str(dims)[:-1] + ", ...]"


# -- the compact round -------------------------------------------------------------
C_FP, C_NOT_FP, C_FLAGS, C_FOLD = range(4)  # its words; the inline payload follows
COMPACT_HEAD = 4
COMPACT_WORDS = COMPACT_HEAD + INLINE_BYTES // 8
COMPACT_BYTES = COMPACT_WORDS * 8
NEED_ROWS = 1  # C_FLAGS: every rank runs the rows round for this call
CONFLICT = -1  # C_FOLD after ranks sent different fold codes
FOLD_NONE, FOLD_BOR = 0, 17  # no inline payload; bitwise OR (root's bytes, others zero)

_FOLD_DTYPES = ("float32", "float64", "int32", "int64")
_FOLD_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
# (dtype code, op) -> fold code 1..16, the numbering `_fastpath.c` shares
FOLDS: dict[tuple[int, ReduceOp], int] = {
    (DTYPE_CODES[d], op): 1 + i * len(_FOLD_DTYPES) + j
    for i, op in enumerate(_FOLD_OPS) for j, d in enumerate(_FOLD_DTYPES)}
# (numpy dtype, op) -> the same fold codes, for the C folds of data in memory
NUMPY_FOLDS: dict[tuple[np.dtype[Any], ReduceOp], int] = {
    (np.dtype(NUMPY_OF_CODE[code]), op): fold for (code, op), fold in FOLDS.items()}
_FOLD_UFUNCS: dict[int, tuple[np.dtype[Any], Any]] = {
    1 + i * len(_FOLD_DTYPES) + j: (np.dtype(d), uf)
    for i, uf in enumerate((np.add, np.multiply, np.minimum, np.maximum))
    for j, d in enumerate(_FOLD_DTYPES)}
_MASK = (1 << 64) - 1


def fold_code(code: int, op: ReduceOp) -> int | None:
    """The compact round's fold of an inline allreduce (an average sums, then the
    caller divides), or None: no fold for that dtype, the rows round folds it."""
    return FOLDS.get((code, ReduceOp.SUM if op is ReduceOp.AVERAGE else op))


@functools.lru_cache(maxsize=64)
def _key_words(kind: int) -> np.ndarray[Any, Any]:
    """The words a fingerprint covers: what `kind` must match, less the sequence
    number (mixed in per call), plus the name label (the matching key)."""
    words = _MATCH.get(Kind(kind), _COMMON)
    return np.array(sorted({w for w in words if w != W_SEQ} | {W_LABEL, W_LABEL2}), np.intp)


_KINDS = frozenset(int(k) for k in Kind)


def key_of_call(header: np.ndarray[Any, Any]) -> int:
    """A 64-bit hash of a packed header's matched words, sequence number left out."""
    kind = int(header[W_KIND]) if int(header[W_MAGIC]) == MAGIC else -1
    words = header[_key_words(kind)] if kind in _KINDS else header[:WORDS]
    digest = hashlib.blake2b(np.ascontiguousarray(words).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def fingerprint(key: int, seq: int) -> int:
    """splitmix64(key ^ seq) as a signed word: a bijection in `seq` for one key, so
    two calls that differ only in their sequence number never share it.
    `_fastpath.c` computes the same."""
    z = ((key ^ seq) + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z


def compact_words(slot: np.ndarray[Any, Any], fold: int, flags: int,
                  out: np.ndarray[Any, Any]) -> None:
    """This rank's compact words from its packed slot (header, then payload)."""
    fp = fingerprint(key_of_call(slot[:WORDS]), int(slot[W_SEQ]))
    out[C_FP], out[C_NOT_FP], out[C_FLAGS], out[C_FOLD] = fp, ~fp, flags, fold
    out[COMPACT_HEAD:] = slot[WORDS: WORDS + COMPACT_WORDS - COMPACT_HEAD]


def compact_agreed(reduced: np.ndarray[Any, Any], fold: int) -> bool:
    """Every rank sent this fingerprint and fold, and none asked for the rows."""
    return (not int(reduced[C_FP]) & int(reduced[C_NOT_FP]) and not int(reduced[C_FLAGS])
            and int(reduced[C_FOLD]) == fold)


def combine(lower: np.ndarray[Any, Any], inout: np.ndarray[Any, Any]) -> None:
    """The compact round's reduction: `inout` = `lower` (the lower ranks) with `inout`.
    Not commutative, so MPI applies it in rank order, as the rows round folds."""
    inout[:C_FOLD] |= lower[:C_FOLD]
    if int(lower[C_FOLD]) != int(inout[C_FOLD]):
        inout[C_FOLD] = CONFLICT
        return
    code = int(inout[C_FOLD])
    a, b = lower[COMPACT_HEAD:], inout[COMPACT_HEAD:]
    if code == FOLD_BOR:
        b |= a
    elif code in _FOLD_UFUNCS:
        dtype, ufunc = _FOLD_UFUNCS[code]
        with np.errstate(all="ignore"):
            ufunc(a.view(dtype), b.view(dtype), out=b.view(dtype))
