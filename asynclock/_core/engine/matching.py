"""Matching calls by name once the ranks' header rounds disagree.

Header rounds pair by position: the n-th round of every rank lands in one
allgather, its slot. While every rank proposes the same call in the same
slot, that is the whole protocol (`Operation._on_header`). On a lane
`by_name` (the user's collectives and process sets), a slot whose headers
differ does not fail; every rank records every rank's proposal in the same
table, and a call runs once every rank has proposed it:

* a named call matches the call of the same name (Horovod's rule); an
  unnamed one matches the unnamed call with the same count of unnamed calls
  before it (W_SEQ), so a named call on one rank shifts nothing;
* when a call is matched, its headers are checked as usual (kind, dtype,
  shape, op, root): a mismatch fails that call with the same error on every
  rank, and nothing else;
* matched calls take their data-stage turn at the slot that matched them,
  in rank 0's proposal order, so data stages keep one order on every rank.

Every rank sees the same rows in the same slot order, so every rank builds
the same table and reaches the same decisions: no local timing enters them.
A rank with calls still waiting keeps the lane turning with `FILLER`
rounds (with backoff while nothing changes), so the other ranks' later
calls can pair with something. When every rank's round in a slot is a
filler flagged WAITING (its waiting calls are awaited past
`ProgressPolicy.stray_s`, or it is shutting down), no rank can make
progress: every waiting call fails with `UnmatchedError`, which names what
each rank issued, and the lane is clean again.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from ..base.backoff import Backoff
from ..base.errors import AsynclockError, UnmatchedError
from ..base.header import (
    SLOT_WORDS,
    W_KIND,
    W_LABEL,
    W_LABEL2,
    W_NAME,
    W_OP,
    W_SEQ,
    WORDS,
    Call,
    check,
    describe_row,
)
from ..base.ops import Kind
from .operation import Lane, LaneHost, Operation, State

Array = np.ndarray[Any, Any]
WAITING = 1  # a filler's W_OP flag: this rank cannot make progress on its own
_FILLER = int(Kind.FILLER)
FILLER_FIRST_S, FILLER_MAX_S = 1e-3, 0.05  # the filler backoff (`Matcher._keep_turning`)


class Entry(NamedTuple):
    """One rank's proposal that waits to be matched."""

    key: tuple[int, ...]
    row: Array  # the rank's whole slot: header and inline payload (a copy)
    op: Operation | None  # this rank's own call; None for the other ranks' entries


def key_of(row: Array) -> tuple[int, ...]:
    """A named call matches by name; an unnamed one by its unnamed-call count."""
    if int(row[W_NAME]):
        return (int(row[W_NAME]), int(row[W_LABEL]), int(row[W_LABEL2]))
    return (0, int(row[W_SEQ]))


class Matcher:
    """The lane's table of unmatched proposals, one list per rank, in slot order."""

    def __init__(self, lane: Lane, host: LaneHost) -> None:
        self.lane, self.host = lane, host
        self.table: list[list[Entry]] = [[] for _ in range(lane.size)]
        # The filler's delay after slots that changed nothing: 1 ms, doubling with
        # each such slot in a row, at most 50 ms.
        self.filler_backoff = Backoff(FILLER_FIRST_S, FILLER_MAX_S, growth=2.0)
        self.processed = 0  # the slot of the last round processed here
        self.closing = False

    # -- processing, in slot order ----------------------------------------------
    def settle(self) -> None:
        """Process every arrived round up to the first one still in flight."""
        q, i = self.lane.queue, 0
        while i < len(q):
            op = q[i]
            if op.state is State.HEADER:
                if not op.arrived:
                    break
                i = self._process(op, i)
            else:
                i += 1
        if not any(self.table) and not any(op.arrived for op in q):
            self.lane.matcher = None  # in step again: the plain path serves the lane

    def _process(self, op: Operation, i: int) -> int:
        """One slot: record its proposals, run what they complete; returns the
        queue index after what now sits at position `i`."""
        lane, table = self.lane, self.table
        rows = op._recv.reshape(lane.size, SLOT_WORDS)
        op.arrived = False
        self.processed = op.slot
        new, waiting = False, True
        for r in range(lane.size):
            row = rows[r]
            if int(row[W_KIND]) == _FILLER:
                waiting = waiting and bool(int(row[W_OP]) & WAITING)
                continue
            waiting = False
            table[r].append(Entry(key_of(row), row.copy(), op if r == lane.rank else None))
            new = True
        del lane.queue[i]
        if op.call.kind is Kind.FILLER:
            op.complete(None)
        matched = self._take_matched()
        for entries in matched:
            own = entries[lane.rank].op
            assert own is not None
            self._run(own, np.stack([e.row for e in entries]))
            if not own.done:
                lane.queue.insert(i, own)
                i += 1
        if waiting and any(table):
            self._expire()
        self._keep_turning(op, bool(new or matched))
        return i

    def _take_matched(self) -> list[list[Entry]]:
        """Remove and return the proposals every rank has made, in rank 0's order."""
        table = self.table
        found: list[list[Entry]] = []
        for first in list(table[0]):
            picks = [first]
            for r in range(1, len(table)):
                pick = next((e for e in table[r] if e.key == first.key), None)
                if pick is None:
                    break
                picks.append(pick)
            else:
                for r, pick in enumerate(picks):
                    table[r].remove(pick)
                found.append(picks)
        return found

    def _run(self, own: Operation, slots: Array) -> None:
        """Every rank proposed `own`'s call: check the headers, then go on as the
        plain path would from agreed rows."""
        header = slots[:, :WORDS].copy()
        header[:, W_SEQ] = header[0, W_SEQ]  # a named call's count may differ by rank
        try:
            check(header, own.call.kind)
        except AsynclockError as exc:
            own.fail(exc)
            return
        own._recv = slots.reshape(-1)
        own.on_rows(slots)

    def _expire(self) -> None:
        """No rank can make progress: every waiting call fails, named on all ranks."""
        parts = []
        for r, entries in enumerate(self.table):
            if entries:
                parts.append(f"rank {r}: " + ", ".join(describe_row(e.row) for e in entries))
        text = ("collectives issued by some ranks only, and no rank can proceed: "
                + "; ".join(parts))
        # The unnamed calls that expired were counted by the ranks that made them:
        # every rank moves its count past the highest, so later ones pair again.
        counts = [e.key[1] for entries in self.table for e in entries if e.key[0] == 0]
        if counts:
            self.lane.seq = max(self.lane.seq, *counts)
        for entries in self.table:
            for entry in entries:
                if entry.op is not None:
                    entry.op.fail(UnmatchedError(text))
            entries.clear()

    # -- fillers --------------------------------------------------------------------
    def _keep_turning(self, op: Operation, progressed: bool) -> None:
        """After a slot: a rank with calls waiting (or shutting down while any
        rank's do) keeps the lane turning when it has no later round in flight."""
        if progressed:
            self.filler_backoff.reset()
            delay = 0.0
        else:
            delay = self.filler_backoff.next_sleep()  # counts the slot even when no filler is due
        if self.filler_due():
            self.host.want_filler(self.lane, delay)

    def filler_due(self) -> bool:
        """Our calls wait (or we close while any rank's do), and no later round of
        ours is in flight: a filler is this rank's next round. Checked again when
        a delayed filler is issued, so no rank ever has a round too many."""
        lane = self.lane
        if lane.rounds != self.processed:
            return False
        return bool(self.table[lane.rank]) or (self.closing and any(self.table))

    def missing_for(self, op: Operation) -> tuple[int, ...] | None:
        """The ranks with no proposal that matches `op`, while `op` waits here."""
        table = self.table
        key = next((e.key for e in list(table[self.lane.rank]) if e.op is op), None)
        if key is None:
            return None
        return tuple(r for r, entries in enumerate(table)
                     if not any(e.key == key for e in list(entries)))

    def stuck(self) -> bool:
        """Flag our filler WAITING: shutting down, or each of our waiting calls is
        awaited and has waited past the stray timeout."""
        if self.closing:
            return True
        own = [e.op for e in self.table[self.lane.rank] if e.op is not None]
        now = time.perf_counter()
        stray_s = self.host.policy.stray_s
        return bool(own) and all(o.waiter is not None and now - o.issued_at > stray_s
                                 for o in own)

    def close(self) -> None:
        """The rank is shutting down: turn until every rank's waiting calls expire."""
        self.closing = True
        if self.filler_due():
            self.host.want_filler(self.lane, 0.0)


def filler_call(lane: Lane, waiting: bool) -> Call:
    return Call(Kind.FILLER, lane.seq, op=WAITING if waiting else 0)
