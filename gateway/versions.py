"""Clients waiting for a job's next version (HTTP ``GET /v1/jobs/{job}/version?after=N&wait_s=S``,
gRPC ``WaitForVersion``), held by the gateway until the version passes ``after`` or ``wait_s``
ends, so that a client between rounds asks once per version instead of polling.

The gateway follows the rounds' events (``ClusterState.follow_events``: a job's name each time
one of its rounds changes). On one for a job that has waiters it reads the job once and answers
every waiter the new version satisfies. A missed message only delays: waited jobs are read
again every ``RECHECK_S`` seconds, and what was read is taken as current for that long at most.

The same events end a secure round's stage waits (``GET /v1/jobs/{job}/secure?round=R&after=STAGE``,
``StageWatch``): a client between two stages asks once per stage.

``Waits`` is the registry, pure; ``RoundWatch`` its shell on the gateway's loop, of which
``VersionWatch`` and ``StageWatch`` say what is read and what ends a wait.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lifl.cluster_types import Job, SecureRound
from lifl.errors import NotFound, Overloaded
from lifl.net.loop import Loop, Timer
from lifl.state import ClusterState

MAX_VERSION_WAITERS = 10_000  # waits held at once by one gateway; past it a wait is refused (503)
RECHECK_S = 1.0  # waited jobs are read again this often, and a read is taken as current this long at most
MAX_FRESH_JOBS = 4096  # jobs whose current read (and round events) a gateway remembers
WAITERS_PUSHBACK_S = 1.0  # what a client refused a wait is asked to wait before it tries again

Answer = Callable[[Any, BaseException | None], None]


@dataclass(eq=False)
class Waiter:
    job: str
    after: Any  # what the waiter saw: a version, or a secure round's (round, stage)
    answer: Answer
    timer: Timer | None = field(default=None, repr=False)


class Waits:
    """Who waits for which job to move past what; no I/O."""

    def __init__(self, limit: int = MAX_VERSION_WAITERS) -> None:
        self.limit = limit
        self.count = 0
        self._by_job: dict[str, list[Waiter]] = {}

    def add(self, waiter: Waiter) -> None:
        if self.count >= self.limit:
            raise Overloaded(f"this gateway holds {self.limit} version waits already; ask again later",
                             code="too_many_waits", retry_after=WAITERS_PUSHBACK_S)
        self._by_job.setdefault(waiter.job, []).append(waiter)
        self.count += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out (False: it was answered already)."""
        waiters = self._by_job.get(waiter.job, [])
        if waiter not in waiters:
            return False
        waiters.remove(waiter)
        if not waiters:
            del self._by_job[waiter.job]
        self.count -= 1
        return True

    def take(self, job: str, moved: Callable[[Any], bool]) -> list[Waiter]:
        """Take out and return the waiters of ``job`` whose ``after`` it ``moved`` past."""
        waiters = self._by_job.get(job, [])
        done = [w for w in waiters if moved(w.after)]
        if done:
            rest = [w for w in waiters if not moved(w.after)]
            if rest:
                self._by_job[job] = rest
            else:
                del self._by_job[job]
            self.count -= len(done)
        return done

    def take_all(self, job: str) -> list[Waiter]:
        waiters = self._by_job.pop(job, [])
        self.count -= len(waiters)
        return waiters

    def jobs(self) -> list[str]:
        return list(self._by_job)

    def __contains__(self, job: str) -> bool:
        return job in self._by_job


class RoundWatch(ABC):
    """Waits held on the gateway's loop until what a job's round events change moves them on:
    ``_read`` says what is read of a job, ``_moved`` whether it moved a waiter's ``after``. One
    read per job at a time; waited jobs are read again every RECHECK_S; a wait that reaches its
    deadline is answered with what is then current."""

    def __init__(self, loop: Loop, name: str, limit: int = MAX_VERSION_WAITERS) -> None:
        self.loop, self.name = loop, name
        self.waits = Waits(limit)
        self._reading: set[str] = set()  # jobs with a refresh on the pool
        self._again: set[str] = set()  # jobs that changed while their refresh was out
        self._recheck: Timer | None = None

    @abstractmethod
    def _read(self, job: str, done: Answer) -> None:
        """Read what the waits of ``job`` are about (on the pool), then ``done(found, error)`` on the loop."""

    @abstractmethod
    def _moved(self, after: Any, found: Any) -> bool:
        """Whether ``found`` is past a waiter's ``after``."""

    def _current(self, job: str, done: Answer) -> None:
        """What a wait at its deadline is answered with (a watch may know it without reading)."""
        self._read(job, done)

    def start(self) -> None:
        """(On the loop.) Read waited jobs again every RECHECK_S."""
        self._recheck = self.loop.every(self.name, RECHECK_S, self._recheck_all)

    def stop(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()

    def changed(self, job: str) -> None:
        """(On the loop.) A round event of ``job`` came."""
        if job in self.waits:
            self._refresh(job)

    def _hold(self, job: str, after: Any, wait_s: float, answer: Answer) -> Waiter | None:
        """Hold ``answer`` until ``job`` moves past ``after``, or for ``wait_s``; None if refused."""
        waiter = Waiter(job, after, answer)
        try:
            self.waits.add(waiter)
        except Overloaded as e:
            answer(None, e)
            return None
        waiter.timer = self.loop.later(wait_s, lambda: self._expired(waiter))
        return waiter

    def _recheck_all(self) -> None:
        for job in self.waits.jobs():
            self._refresh(job)

    def _refresh(self, job: str) -> None:
        """Read ``job`` (one read however many wait for it) and answer whom it moved on."""
        if job in self._reading:
            self._again.add(job)
            return
        self._reading.add(job)

        def read(found: Any, error: BaseException | None) -> None:
            self._reading.discard(job)
            if isinstance(error, NotFound):  # the job is gone: so is what its waiters wait for
                for waiter in self.waits.take_all(job):
                    self._answer(waiter, None, error)
            elif error is None:
                for waiter in self.waits.take(job, lambda after: self._moved(after, found)):
                    self._answer(waiter, found, None)
            # another error (Redis away): the next event, recheck or deadline tries again
            if job in self._again:
                self._again.discard(job)
                if job in self.waits:
                    self._refresh(job)

        self._read(job, read)

    def _expired(self, waiter: Waiter) -> None:
        if self.waits.remove(waiter):
            self._current(waiter.job, waiter.answer)

    @staticmethod
    def _answer(waiter: Waiter, found: Any, error: BaseException | None) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.answer(found, error)


class VersionWatch(RoundWatch):
    """The version waits of one gateway and what it knows to be current, on its loop (the loop's
    alone, but for the events' thread, which only posts to it).

    A job read while no round event for it came is *fresh* for RECHECK_S: waits and version
    checks are answered from it without Redis, so an answer may lag an install by the event's
    delivery (milliseconds; RECHECK_S at most if the event is lost). ``on_change`` listeners
    (the gateway's shared model references, its stage waits) hear of each event as it comes."""

    def __init__(self, loop: Loop, state: ClusterState, limit: int = MAX_VERSION_WAITERS) -> None:
        super().__init__(loop, "version waits", limit)
        self.state = state
        self._generations: dict[str, int] = {}  # round events seen per job
        self._fresh: dict[str, tuple[Job, int, float]] = {}  # job -> (read, its generation, when the read began)
        self._listeners: list[Callable[[str], None]] = []
        self._stopping = False

    def start(self) -> None:
        """(On the loop.) Follow the round events, and read waited jobs again every RECHECK_S."""
        super().start()
        threading.Thread(target=self.state.follow_events, name="gateway-events", daemon=True,
                         args=(lambda job: self.loop.post(lambda: self._changed(job)), lambda: self._stopping,
                               "lifl gateway")).start()

    def stop(self) -> None:
        """(On the loop.) Stop following; a wait still held ends as its connection does."""
        self._stopping = True
        super().stop()

    # -- what is current ------------------------------------------------------------------------
    def _generation(self, job: str) -> int:
        """A number that changes with each round event of ``job`` (compare it before and after)."""
        return self._generations.get(job, 0)

    def _unchanged(self, job: str, generation: int, since: float) -> bool:
        """No round event of ``job`` came since ``generation`` was taken at ``since`` (clock), and
        that was less than RECHECK_S ago (an event missed meanwhile goes unseen no longer)."""
        return self._generation(job) == generation and time.monotonic() - since < RECHECK_S

    def on_change(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def fresh(self, job: str) -> Job | None:
        entry = self._fresh.get(job)
        if entry is None or not self._unchanged(job, entry[1], entry[2]):
            return None
        return entry[0]

    def _read(self, job: str, done: Answer) -> None:
        """Read ``job`` from Redis on the pool; remembered as fresh if no event came meanwhile."""
        generation, began = self._generation(job), time.monotonic()

        def read(found: Job | None, error: BaseException | None) -> None:
            if found is not None and self._generation(job) == generation:
                if len(self._fresh) >= MAX_FRESH_JOBS and job not in self._fresh:
                    self._fresh.clear()
                self._fresh[job] = (found, generation, began)
            done(found, error)

        self.loop.offload(lambda: self.state.job(job), read)

    def _moved(self, after: int, found: Job) -> bool:
        return found.version > after

    def _current(self, job: str, done: Answer) -> None:
        known = self.fresh(job)
        if known is not None:
            done(known, None)
        else:
            self._read(job, done)

    def _changed(self, job: str) -> None:
        if len(self._generations) >= MAX_FRESH_JOBS and job not in self._generations:
            self._generations.clear()  # every entry changes generation: nothing is taken as unchanged
            self._fresh.clear()
        self._generations[job] = self._generation(job) + 1
        self._fresh.pop(job, None)
        for listener in self._listeners:
            listener(job)
        self.changed(job)

    # -- waits ------------------------------------------------------------------------------------
    def wait(self, job: str, after: int, wait_s: float, check: Callable[[Job], None], answer: Answer) -> None:
        """(On the loop.) ``answer(job)`` once its version is past ``after``, or after ``wait_s``
        with the version then; ``check(job)`` (authorization) runs first."""
        def begin(found: Job | None, error: BaseException | None) -> None:
            if error is not None:
                answer(None, error)
                return
            assert found is not None
            try:
                check(found)
            except Exception as e:
                answer(None, e)
                return
            if found.version > after or wait_s <= 0:
                answer(found, None)
            elif self._hold(job, after, wait_s, answer) is not None and self.fresh(job) is None:
                self._refresh(job)  # an event came while it was read: what was read may be older

        self._current(job, begin)


class StageWatch(RoundWatch):
    """Clients waiting for a secure round to move past the stage they saw (``after`` is the
    round and stage), on the gateway's loop; the version watch's events wake it (``changed``)."""

    def __init__(self, loop: Loop, read: Callable[[str], SecureRound | None], limit: int = MAX_VERSION_WAITERS) -> None:
        super().__init__(loop, "stage waits", limit)
        self.read_round = read

    def _read(self, job: str, done: Answer) -> None:
        self.loop.offload(lambda: self.read_round(job), done)

    def _moved(self, after: tuple[int, str], found: SecureRound | None) -> bool:
        return found is None or (found.round, found.stage) != after

    def wait(self, job: str, after: tuple[int, str], seen: SecureRound | None, wait_s: float, answer: Answer) -> None:
        """(On the loop.) ``answer(round)`` once the job's secure round is past ``after``, or
        after ``wait_s`` with the round then; ``seen`` is the round as just read."""
        if self._moved(after, seen) or wait_s <= 0:
            answer(seen, None)
        elif self._hold(job, after, wait_s, answer) is not None:
            self._refresh(job)  # it may have moved between that read and this hold
