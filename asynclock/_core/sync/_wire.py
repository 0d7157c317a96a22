"""The messages sync primitives exchange, and where each primitive lives.

Every message is a short vector of int64 words, `[kind, obj, ticket, args...]`,
sent point to point on the sync lane's own communicator. `obj` names the
primitive (a hash of its kind and name, so a Lock and an Event called "x"
never meet); `ticket` names one request of one task on the sending rank, so
replies, cancellations and late grants can be matched without ambiguity.
Messages between two ranks are never overtaken (MPI's ordering rule), which
the cancellation protocol relies on: a CANCEL always reaches the home rank
after the ACQUIRE it withdraws.
"""

from __future__ import annotations

import enum
import hashlib
import zlib
from collections.abc import Sequence

MAX_WORDS = 64  # receive buffer: 512 bytes, enough for INFO with 57 ranks listed
HEAD = 3  # kind, obj, ticket


class M(enum.IntEnum):
    """Message kinds; requests go to a primitive's home rank, replies come back."""

    ACQUIRE = 1  # args: capacity, nowait
    RELEASE = 2
    CANCEL = 3
    COND_WAIT = 4  # args: condition id (release the lock and wait on the condition)
    COND_CANCEL = 5  # args: condition id (stop waiting: just reacquire the lock)
    NOTIFY = 6  # args: condition id, n (-1: all)
    INFO = 7  # args: condition id
    EVENT_WAIT = 8
    EVENT_SET = 9
    EVENT_CANCEL = 10
    PING = 11
    TOKEN = 12  # sequential sections: args: generation the receiver may enter
    BUSY = 13  # a leaseholder's answer to RECALL: in use, RELEASE follows
    RECALL = 14  # home -> leaseholder: someone waits, give the permit back
    GRANT = 20  # args: lease (1: the holder may keep the permit cached after release)
    DENY = 21  # + info
    WITHDRAWN = 22  # + info
    INFO_REPLY = 23  # + info
    FIRED = 24
    PONG = 25
    ERROR = 26  # args: error code, expected value
    EVENT_KNOWN = 27  # an event was set: tell every rank so `is_set()` turns true


class ErrorCode(enum.IntEnum):
    CAPACITY_MISMATCH = 1
    NOT_HOLDER = 2


def object_id(kind: str, name: str) -> int:
    """Stable 62-bit id of a primitive (`hash()` is salted per process)."""
    digest = hashlib.blake2b(f"{kind}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def home_rank(name: str, size: int) -> int:
    """The rank whose manager serves primitive `name`: spread by crc32."""
    return zlib.crc32(name.encode()) % size


def info_words(capacity: int, holders: list[int], waiters: list[int], cond: int,
               leased: list[int]) -> list[int]:
    """Manager state for error messages: counts, then holder, waiter, lease ranks."""
    room = MAX_WORDS - HEAD - 5
    listed = (holders + waiters + leased)[:room]
    return [capacity, len(holders), len(waiters), cond, len(leased), *listed]


Info = tuple[int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]


def parse_info(words: Sequence[int]) -> Info:
    """`(capacity, holders, waiters, condition waiters, leaseholders)`; lists may be cut."""
    capacity, nh, nw, cond, nl = (int(w) for w in words[HEAD: HEAD + 5])
    listed = [int(w) for w in words[HEAD + 5:]]
    return (capacity, tuple(listed[:nh]), tuple(listed[nh: nh + nw]), cond,
            tuple(listed[nh + nw: nh + nw + nl]))
