"""Heartbeats between ranks, and the stall inspector that reads them.

MPI says nothing when a peer goes silent: a rank SIGKILLed under a launcher
that does not clean up, a frozen process, or a cut TCP link (MPICH over TCP
hangs silently) leave every other rank blocked in its next collective for
ever. Invariant 2 (no silent hang) therefore needs a signal of its own.

One daemon thread per rank, on its own communicator (`MPIBackend.watchdog_comm`;
without MPI, a TCP mesh of its own: `heartbeat`), every `ASYNCLOCK_HEARTBEAT_S` (0.5 s):

* sends each live peer a small status: state (running, closing, failed),
  the issued sequence number of every lane, this rank's oldest in-flight
  operation and its age, and how long its event loop has left a ping
  unanswered;
* receives the peers' statuses (improbe + recv: it never blocks in MPI);
* takes a peer silent for `ASYNCLOCK_DEAD_AFTER_S` (10 s) for dead, and a
  peer that reports `failed` (uncaught exception, stall abort) stops us too;
* reports a stall once per operation when this rank's oldest operation has
  waited `ASYNCLOCK_STALL_WARN_S` (60 s, as Horovod): the missing ranks are
  those whose published issued-seq on that lane is below the operation's;
  `ASYNCLOCK_STALL_ABORT_S` (off by default) makes it a job shutdown.

A thread and not a task: the rank that stalls everyone is often the one
whose event loop is blocked, and its heartbeat must still go out. A fatal
event prints one rank-tagged line, tells the live peers, fails every
in-flight operation through the loop (`Engine.fail_all_soon`) and exits
after `ASYNCLOCK_FAILURE_GRACE_S` (2 s) with `os._exit` (see
`runtime.failure` for why not MPI_Abort). A clean shutdown sends
`closing`, so peers never take a finished rank for a dead one, and a peer
still waiting on it gets a clear error instead of a hang.

In an elastic job (`WatchdogPolicy.reform`) a lost peer ends the world, not
the process: a peer whose heartbeat link closed is lost at once (its process
ended), a silent one after `dead_after_s`; the verdict is printed once, sent
to the live peers word for word (so every survivor raises the same
`RankFailedError`), fails every in-flight operation, and the thread ends,
leaving `lost` for `runtime.elastic`, which re-forms the world.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..base import settings, stack_dump
from ..base.backoff import Backoff, poll_until
from ..base.errors import RankFailedError, StallError
from ..base.from_thread import name_os_thread
from ..engine.progress import Engine, EngineSnapshot, InflightOp
from ..transports.heartbeat import Heartbeats
from .exits import EXIT_RANK_FAILED, EXIT_STALL, hard_exit, write_stderr

log = logging.getLogger("asynclock.watchdog")

RUNNING, CLOSING, FAILED = 0, 1, 2
LAG_NOTE_S = 1.0  # an event loop that has not run for this long is worth naming
# This rank dumps its stacks when its own heartbeat thread stalled for this share of
# dead_after_s: before the peers declare it dead and the launcher kills it (`stack_dump`).
FROZEN_FRACTION = 0.8
MAX_PENDING_SENDS = 256  # a frozen peer must not make us queue heartbeats for ever
FLUSH_POLL_S = 1e-3  # last sends (failure, goodbye) are tested this often


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    """Thresholds, from ASYNCLOCK_HEARTBEAT_S, _DEAD_AFTER_S, _STALL_WARN_S,
    _STALL_ABORT_S (0: never) and _FAILURE_GRACE_S."""

    heartbeat_s: float = 0.5
    dead_after_s: float = 10.0
    stall_warn_s: float = 60.0
    stall_abort_s: float = 0.0
    grace_s: float = 2.0
    reform: bool = False  # a lost peer ends the world, not the process (elastic jobs)

    @classmethod
    def from_env(cls, reform: bool = False) -> WatchdogPolicy:
        return cls(settings.number("ASYNCLOCK_HEARTBEAT_S"),
                   settings.number("ASYNCLOCK_DEAD_AFTER_S"),
                   settings.number("ASYNCLOCK_STALL_WARN_S"),
                   settings.number("ASYNCLOCK_STALL_ABORT_S"),
                   settings.number("ASYNCLOCK_FAILURE_GRACE_S"), reform)


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """What a rank publishes with each heartbeat (sent as a plain tuple)."""

    state: int = RUNNING
    seqs: tuple[int, ...] = ()
    oldest: str = ""
    oldest_age: float = 0.0
    loop_lag: float = 0.0
    reason: str = ""
    exit_code: int = 0  # with `failed`: the status every rank ends with (0: EXIT_RANK_FAILED)


@dataclass(frozen=True, slots=True)
class WatchdogStatistics:
    running: bool
    heartbeats_sent: int
    heartbeats_received: int
    cpu_s: float  # this thread's own CPU time
    stalls_reported: int
    pending_sends: int  # heartbeats not yet completed by MPI (stays near 0)
    closed_peers: tuple[int, ...]
    stopping: str | None


# -- report texts (pure, so they can be tested without MPI) -----------------------
def missing_ranks(op: InflightOp, peers: dict[int, PeerStatus | None]) -> list[int]:
    """Peers that have not issued `op` yet, by their published lane seq."""
    out = []
    for rank, st in sorted(peers.items()):
        if st is None or not 0 <= op.lane < len(st.seqs) or st.seqs[op.lane] < op.seq:
            out.append(rank)
    return out


def peer_note(rank: int, st: PeerStatus | None, lane: int, lane_names: tuple[str, ...]) -> str:
    """`rank 1: issued up to #2 on lane user, has nothing in flight`."""
    if st is None:
        return f"rank {rank}: no heartbeat received yet"
    parts = ["has shut asynclock down"] if st.state == CLOSING else []
    if 0 <= lane < len(st.seqs) and lane < len(lane_names):
        parts.append(f"issued up to #{st.seqs[lane]} on lane {lane_names[lane]}")
    parts.append(f"waits in {st.oldest} for {st.oldest_age:.1f} s" if st.oldest
                 else "has nothing in flight")
    if st.loop_lag >= LAG_NOTE_S:
        parts.append(f"its event loop has not run for {st.loop_lag:.1f} s")
    return f"rank {rank}: " + ", ".join(parts)


def stall_text(op: InflightOp, lane_names: tuple[str, ...],
               peers: dict[int, PeerStatus | None], own_lag: float = 0.0) -> str:
    """`stall: waiting 61.0 s in barrier #3 on lane user; missing ranks [1] (...)`."""
    head = f"stall: waiting {op.age_s:.1f} s in {op.description}"
    if own_lag >= LAG_NOTE_S:  # then the culprit may be this rank's own blocking call
        head += f" (and this rank's event loop has not run for {own_lag:.1f} s)"
    if op.unmatched_by:
        missing = list(op.unmatched_by)
        notes = "; ".join(peer_note(r, peers.get(r), op.lane, lane_names) for r in missing)
        return (f"{head}; ranks {missing} have not issued it (it waits to be matched by "
                f"name or unnamed-call count: {notes})")
    if op.lane >= 0 and (missing := missing_ranks(op, peers)):
        notes = "; ".join(peer_note(r, peers[r], op.lane, lane_names) for r in missing)
        return f"{head}; missing ranks {missing} ({notes})"
    notes = "; ".join(peer_note(r, st, op.lane, lane_names) for r, st in sorted(peers.items()))
    if op.lane >= 0:
        return f"{head}; every rank has issued it ({notes})"
    return f"{head}; peers: {notes}"


def doing_text(snap: EngineSnapshot) -> str:
    if not snap.ops:
        return "this rank has nothing in flight"
    op = snap.ops[0]
    return f"this rank waits in {op.description} (for {op.age_s:.1f} s)"


def relay_text(peer: int, reason: str) -> str:
    """A peer's `failed` reason, naming the peer when it reports someone else."""
    return reason if reason.startswith(f"rank {peer} ") else f"{reason} (reported by rank {peer})"


def reason_for_peers(rank: int, message: str, relayed: bool) -> str:
    """What this rank's `failed` status says: the job's stop names the rank that
    decided it. A relayed stop keeps its origin's words, so a rank that hears it
    from a second peer first reads the same reason, not one nested in another."""
    if relayed or message.startswith(f"rank {rank} "):
        return message
    return f"rank {rank} stopped the job: {message}"


def _thread_multiple() -> bool:
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


class Watchdog:
    """The heartbeat thread of one rank; `close()` is the clean shutdown."""

    def __init__(self, heartbeats: Heartbeats | None, engine: Engine, rank: int, size: int,
                 policy: WatchdogPolicy | None = None) -> None:
        self.heartbeats, self.engine, self.rank, self.size = heartbeats, engine, rank, size
        self.policy = policy or WatchdogPolicy.from_env()
        self.peers: dict[int, PeerStatus | None] = {r: None for r in range(size) if r != rank}
        now = time.monotonic()
        self._heard = dict.fromkeys(self.peers, now)
        self._closed: set[int] = set()
        self._dead: set[int] = set()
        self._sends: list[tuple[int, Any]] = []  # (peer, request)
        self._reported: set[int] = set()
        self._closed_seen: dict[tuple[int, int], float] = {}  # (peer, op) -> first verdict
        self._wake, self._stop, self._told = threading.Event(), threading.Event(), threading.Event()
        self._fatal: tuple[str, type[Exception] | None, bool] | None = None
        self._relayed = False  # the stop came from a peer's `failed` status
        self.stopping: str | None = None
        self.lost: RankFailedError | None = None  # reform: the verdict that ended the world
        self.exit_code = 0
        self._job_code = 0  # a `sys.exit(n)` somewhere: every rank ends with n
        self._ping_at: float | None = None
        self._lag = 0.0
        self._sent = self._received = self._stalls = 0
        self._cpu = 0.0
        self._errors = 0
        self._last_snap = EngineSnapshot((), 0, (), ())  # sent if a snapshot fails
        self._thread = threading.Thread(target=self._run, name=f"asynclock-watchdog-{rank}",
                                        daemon=True)

    @classmethod
    def start_for(cls, backend: Any, engine: Engine, rank: int, size: int,
                  reform: bool = False) -> Watchdog | None:
        """Start one when the transport carries heartbeats and there are peers."""
        heartbeats: Heartbeats | None = getattr(backend, "heartbeats", None)
        if heartbeats is None or size <= 1 or not settings.flag("ASYNCLOCK_WATCHDOG"):
            return None
        if heartbeats.needs_thread_multiple and not _thread_multiple():
            log.warning("asynclock[rank %d]: MPI is not MPI_THREAD_MULTIPLE: no heartbeats, "
                        "so a dead or frozen rank will not be detected", rank)
            return None
        dog = cls(heartbeats, engine, rank, size, WatchdogPolicy.from_env(reform))
        dog.start()
        return dog

    # -- lifecycle (caller's thread) ---------------------------------------------
    def start(self) -> None:
        self._thread.start()
        atexit.register(self.close)  # before mpi4py's MPI_Finalize, whatever the user forgot

    def close(self) -> None:
        """Clean shutdown: say `closing`, stop the thread, leave no request behind."""
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=self.policy.grace_s + 5.0)

    def check_now(self) -> None:
        """Look at the peers now rather than at the next beat (a collective failed)."""
        self._wake.set()

    def announce_failure(self, summary: str) -> None:
        """This rank raised: tell every live peer now (the caller then exits)."""
        self._set_fatal(f"rank {self.rank} failed with {summary}", None, 1, local=False)
        self._wake.set()
        if self._thread.is_alive():
            self._told.wait(timeout=2.0)

    def announce_exit(self, code: int) -> None:
        """This rank called `sys.exit(code)`: every live peer stops with `code` too."""
        self._job_code = code
        self._set_fatal(f"rank {self.rank} exited with status {code}", None, code, local=False)
        self._wake.set()
        if self._thread.is_alive():
            self._told.wait(timeout=2.0)

    def statistics(self) -> WatchdogStatistics:
        return WatchdogStatistics(self._thread.is_alive(), self._sent, self._received, self._cpu,
                                  self._stalls, len(self._sends), tuple(sorted(self._closed)),
                                  self.stopping)

    def _set_fatal(self, message: str, error: type[Exception] | None, code: int, *,
                   local: bool = True) -> None:
        if self.stopping is None:
            self.stopping, self.exit_code = message, code
            self._fatal = (message, error, local)

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("asynclock-watch")
        while not self._stop.is_set() and self._fatal is None:
            self._wake.clear()
            self._tick()
            stack_dump.arm(FROZEN_FRACTION * self.policy.dead_after_s)
            if self._fatal is None:
                self._wake.wait(self.policy.heartbeat_s)
        stack_dump.disarm()
        self._cpu = time.thread_time()
        if self._fatal is not None:
            self._die(*self._fatal)
        else:
            self._goodbye()

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            snap = self._last_snap = self.engine.snapshot()
        except Exception as exc:  # a broken report must never stop the heartbeats
            self._note_error(exc)
            snap = self._last_snap
        self._ping_loop(now)
        try:
            self._drain(now)  # first: a peer that said `closing` needs no more heartbeats
            self._check_links()
            self._reap()
            if self._fatal is None:
                self._send_all(self._status(snap, RUNNING))
        except Exception as exc:  # e.g. MPI reporting a dead peer: silence will tell
            if not (self.policy.reform and self.heartbeats and self.heartbeats.lost()):
                self._note_error(exc)  # re-forming, a closed link is named just below
        self._check_peers(now, snap)
        self._check_stall(snap)
        self._cpu = time.thread_time()

    def _note_error(self, exc: Exception) -> None:
        """Say it once; the peers' silence then decides, after dead_after_s."""
        if not self._errors:
            write_stderr(f"asynclock[rank {self.rank}]: watchdog: {exc!r}\n")
        self._errors += 1

    def _status(self, snap: EngineSnapshot, state: int, reason: str = "") -> tuple[Any, ...]:
        oldest = snap.ops[0] if snap.ops else None
        return (state, snap.lane_seqs, oldest.description if oldest else "",
                oldest.age_s if oldest else 0.0, self._lag, reason, self._job_code)

    def _send_all(self, status: tuple[Any, ...]) -> None:
        heartbeats = self.heartbeats
        if len(self._sends) > MAX_PENDING_SENDS or heartbeats is None:
            return
        for peer in self.peers:
            if peer not in self._closed and peer not in self._dead:
                self._sends.append((peer, heartbeats.send(status, peer)))
                self._sent += 1

    def _reap(self, *, quiet: bool = False) -> None:
        """Drop the completed sends. A send that fails to a peer that said `closing`
        (its end of the TCP mesh is gone), or any failing send when `quiet`, is
        dropped without a word: a peer that has left needs no more statuses."""
        pending: list[tuple[int, Any]] = []
        error: Exception | None = None
        for peer, req in self._sends:
            try:
                if not req.Test():
                    pending.append((peer, req))
            except Exception as exc:
                if quiet or peer in self._closed:
                    log.debug("asynclock[rank %d]: rank %d has left: %r", self.rank, peer, exc)
                else:
                    error = error or exc
        self._sends = pending
        if error is not None:
            raise error

    def _drain(self, now: float) -> None:
        assert self.heartbeats is not None
        for peer, status in self.heartbeats.receive():
            self._on_status(peer, PeerStatus(*status), now)

    def _on_status(self, peer: int, st: PeerStatus, now: float) -> None:
        self._received += 1
        self._heard[peer] = now
        self.peers[peer] = st
        if st.state == CLOSING:
            self._closed.add(peer)
        elif st.state == FAILED and self.stopping is None:
            self._job_code = st.exit_code  # a `sys.exit(n)`: relayed, so every rank ends with n
            self._relayed = True
            # re-forming, every survivor raises the origin's words: the same error everywhere
            reason = st.reason if self.policy.reform else relay_text(peer, st.reason)
            self._set_fatal(reason, RankFailedError, st.exit_code or EXIT_RANK_FAILED)

    def _ping_loop(self, now: float) -> None:
        """Measure how long the event loop leaves a callback waiting."""
        if self._ping_at is not None:
            self._lag = now - self._ping_at
            return
        self._lag, self._ping_at = 0.0, now
        if not self.engine.call_soon_threadsafe(self._pong):
            self._ping_at = None

    def _pong(self) -> None:
        self._ping_at = None

    # -- what the statuses tell us ---------------------------------------------------
    def _check_links(self) -> None:
        """Re-forming: a peer whose link closed without saying `closing` has ended."""
        if not self.policy.reform or self.heartbeats is None or self._fatal is not None:
            return
        for peer in sorted(self.heartbeats.lost() - self._closed):
            self._dead.add(peer)
            self._set_fatal(f"rank {peer} left the job: its connection closed (it exited or "
                            "died)", RankFailedError, EXIT_RANK_FAILED)
            return

    def _check_peers(self, now: float, snap: EngineSnapshot) -> None:
        for peer, heard in self._heard.items():
            silent = now - heard
            if peer not in self._closed and silent > self.policy.dead_after_s:
                self._dead.add(peer)
                self._set_fatal(f"rank {peer} is unreachable: no heartbeat for {silent:.1f} s "
                                "(it died, froze, or its link is down)",
                                RankFailedError, EXIT_RANK_FAILED)
                return
        self._check_closed_peers(now, snap)

    def _check_closed_peers(self, now: float, snap: EngineSnapshot) -> None:
        """A peer that shut down can never join an operation it did not issue.

        The verdict must hold for `dead_after_s`: a peer's last status can be a
        snapshot taken just before it issued the op we wait in, and the op then
        completes here moments later (seen with short-lived gradient lanes).
        """
        live = {op.ident for op in snap.ops}
        self._closed_seen = seen = {k: t for k, t in self._closed_seen.items() if k[1] in live}
        for op in snap.ops:
            for peer in sorted(self._closed):
                st = self.peers[peer]
                if st is not None and 0 <= op.lane < len(st.seqs) and st.seqs[op.lane] < op.seq:
                    if now - seen.setdefault((peer, op.ident), now) < self.policy.dead_after_s:
                        continue
                    self._set_fatal(
                        f"rank {peer} shut asynclock down after issuing #{st.seqs[op.lane]} on "
                        f"lane {snap.lane_names[op.lane]}, so {op.description} can never complete",
                        RankFailedError, EXIT_RANK_FAILED)
                    return

    def _check_stall(self, snap: EngineSnapshot) -> None:
        self._reported &= {op.ident for op in snap.ops}
        if not snap.ops or self._fatal is not None:
            return
        op, p = snap.ops[0], self.policy
        if p.stall_abort_s > 0 and op.age_s >= p.stall_abort_s and not op.waits_by_design:
            self._set_fatal(stall_text(op, snap.lane_names, self.peers, self._lag), StallError,
                            EXIT_STALL)
        elif op.age_s >= p.stall_warn_s and op.ident not in self._reported:
            self._reported.add(op.ident)
            self._stalls += 1
            log.warning("asynclock[rank %d]: %s", self.rank,
                        stall_text(op, snap.lane_names, self.peers, self._lag))

    # -- endings -----------------------------------------------------------------------
    def _die(self, message: str, error: type[Exception] | None, local: bool) -> None:
        """Report once, tell the peers, fail the waiters, exit after the grace."""
        snap = self.engine.snapshot()
        if self.policy.reform and error is RankFailedError:
            self._leave_world(message, snap)
            return
        doing = "" if error is StallError else f"; {doing_text(snap)}"
        if local:
            write_stderr(f"asynclock[rank {self.rank}]: {message}{doing}; "
                         f"stopping the job (exit {self.exit_code})\n")
        reason = reason_for_peers(self.rank, message, self._relayed)
        try:
            self._send_all(self._status(snap, FAILED, reason[:2000]))
        except Exception as exc:
            self._note_error(exc)
        self._flush_sends(0.5)
        self._told.set()
        if error is not None:
            self.engine.fail_all_soon(error(f"{message}{doing}"))
        time.sleep(self.policy.grace_s)
        hard_exit(self.exit_code)

    def _leave_world(self, message: str, snap: EngineSnapshot) -> None:
        """Re-forming: report once, tell the live peers in the same words, fail the
        waiters with that error; the process goes on (`runtime.elastic`)."""
        write_stderr(f"asynclock[rank {self.rank}]: {message}; {doing_text(snap)}; "
                     "re-forming the job without it\n")
        if self.heartbeats is not None:
            self._dead |= self.heartbeats.lost()  # no status to a peer whose link closed
        try:
            self._send_all(self._status(snap, FAILED, message[:2000]))
        except Exception as exc:
            self._note_error(exc)
        self._flush_sends(0.5)
        self.lost = RankFailedError(message)
        self._told.set()
        self.engine.fail_all_soon(RankFailedError(message))

    def _goodbye(self) -> None:
        """Clean close: peers stop expecting us; nothing pending at MPI_Finalize.

        The peers shut down at about the same time, and one that has already
        closed its end (under `horovodrun --gloo` its TCP mesh then resets) needs
        no goodbye: what fails to reach a peer here is no error, only logged at
        debug level. A peer's own `closing` is read first, so it is not even tried.
        """
        assert self.heartbeats is not None
        try:
            self._drain(time.monotonic())
        except Exception as exc:
            log.debug("asynclock[rank %d]: watchdog close: %r", self.rank, exc)
        status = self._status(self.engine.snapshot(), CLOSING)
        for peer in self.peers:
            if peer in self._closed or peer in self._dead:
                continue
            try:
                self._sends.append((peer, self.heartbeats.send(status, peer)))
            except Exception as exc:
                log.debug("asynclock[rank %d]: rank %d has left: %r", self.rank, peer, exc)
        self._flush_sends(2.0)

    def _flush_sends(self, timeout: float) -> None:
        """Wait up to `timeout` for the sends; those to peers that left are dropped."""
        def sent() -> bool:
            if self._sends:
                self._reap(quiet=True)
            return not self._sends

        poll_until(sent, Backoff.every(FLUSH_POLL_S), timeout)
        for _peer, req in self._sends:  # a dead or frozen peer: do not wait in MPI_Finalize
            try:
                req.Cancel()
                req.Free()
            except Exception:
                pass
        self._sends.clear()
