"""Clients waiting for a job's next version (HTTP ``GET /v1/jobs/{job}/version?after=N&wait_s=S``,
gRPC ``WaitForVersion``), held by the gateway until the version passes ``after`` or ``wait_s``
ends, so that a client between rounds asks once per version instead of polling.

The gateway follows the rounds' events (``ClusterState.follow_events``: a job's name each time
one of its rounds changes). On one for a job that has waiters it reads the job once and answers
every waiter the new version satisfies. A missed message only delays: waited jobs are read
again every ``RECHECK_S`` seconds, and what was read is taken as current for that long at most.

``VersionWaits`` is the registry, pure; ``VersionWatch`` is its shell on the gateway's loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lifl.cluster_types import Job
from lifl.errors import NotFound, Overloaded
from lifl.net.loop import Loop, Timer
from lifl.state import ClusterState

MAX_VERSION_WAITERS = 10_000  # waits held at once by one gateway; past it a wait is refused (503)
RECHECK_S = 1.0  # waited jobs are read again this often, and a read is taken as current this long at most
MAX_FRESH_JOBS = 4096  # jobs whose current read (and round events) a gateway remembers
WAITERS_PUSHBACK_S = 1.0  # what a client refused a wait is asked to wait before it tries again

Answer = Callable[[Job | None, BaseException | None], None]


@dataclass(eq=False)
class Waiter:
    job: str
    after: int
    answer: Answer
    timer: Timer | None = field(default=None, repr=False)


class VersionWaits:
    """Who waits for which job's version to pass what; no I/O."""

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

    def passed(self, job: str, version: int) -> list[Waiter]:
        """Take out and return the waiters of ``job`` that ``version`` satisfies."""
        waiters = self._by_job.get(job, [])
        done = [w for w in waiters if w.after < version]
        if done:
            rest = [w for w in waiters if w.after >= version]
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


class VersionWatch:
    """The waits of one gateway and what it knows to be current, on its loop (the loop's alone,
    but for the events' thread, which only posts to it).

    A job read while no round event for it came is *fresh* for RECHECK_S: waits and version
    checks are answered from it without Redis, so an answer may lag an install by the event's
    delivery (milliseconds; RECHECK_S at most if the event is lost). ``on_change`` listeners
    (the gateway's shared model references) hear of each event as it comes."""

    def __init__(self, loop: Loop, state: ClusterState, limit: int = MAX_VERSION_WAITERS) -> None:
        self.loop, self.state = loop, state
        self.waits = VersionWaits(limit)
        self._generations: dict[str, int] = {}  # round events seen per job
        self._fresh: dict[str, tuple[Job, int, float]] = {}  # job -> (read, its generation, when the read began)
        self._listeners: list[Callable[[str], None]] = []
        self._reading: set[str] = set()  # jobs with a refresh on the pool
        self._again: set[str] = set()  # jobs that changed while their refresh was out
        self._stopping = False
        self._recheck: Timer | None = None

    def start(self) -> None:
        """(On the loop.) Follow the round events, and read waited jobs again every RECHECK_S."""
        self._recheck = self.loop.every("version waits", RECHECK_S, self._recheck_all)
        threading.Thread(target=self.state.follow_events, name="gateway-events", daemon=True,
                         args=(lambda job: self.loop.post(lambda: self._changed(job)), lambda: self._stopping,
                               "lifl gateway")).start()

    def stop(self) -> None:
        """(On the loop.) Stop following; a wait still held ends as its connection does."""
        self._stopping = True
        if self._recheck is not None:
            self._recheck.cancel()

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

    def _changed(self, job: str) -> None:
        if len(self._generations) >= MAX_FRESH_JOBS and job not in self._generations:
            self._generations.clear()  # every entry changes generation: nothing is taken as unchanged
            self._fresh.clear()
        self._generations[job] = self._generation(job) + 1
        self._fresh.pop(job, None)
        for listener in self._listeners:
            listener(job)
        if job in self.waits:
            self._refresh(job)

    # -- waits ------------------------------------------------------------------------------------
    def wait(self, job: str, after: int, wait_s: float, check: Callable[[Job], None], answer: Answer) -> None:
        """(On the loop.) ``answer(job)`` once its version is past ``after``, or after ``wait_s``
        with the version then; ``check(job)`` (authorization) runs first."""
        known = self.fresh(job)
        if known is not None:
            self._begin(known, after, wait_s, check, answer)
            return

        def read(found: Job | None, error: BaseException | None) -> None:
            if error is not None:
                answer(None, error)
                return
            assert found is not None
            self._begin(found, after, wait_s, check, answer)

        self._read(job, read)

    def _begin(self, job: Job, after: int, wait_s: float, check: Callable[[Job], None], answer: Answer) -> None:
        try:
            check(job)
        except Exception as e:
            answer(None, e)
            return
        if job.version > after or wait_s <= 0:
            answer(job, None)
            return
        waiter = Waiter(job.spec.job, after, answer)
        try:
            self.waits.add(waiter)
        except Overloaded as e:
            answer(None, e)
            return
        waiter.timer = self.loop.later(wait_s, lambda: self._expired(waiter))
        if self.fresh(waiter.job) is None:  # an event came while it was read: what was read may be older
            self._refresh(waiter.job)

    def _recheck_all(self) -> None:
        for job in self.waits.jobs():
            self._refresh(job)

    def _refresh(self, job: str) -> None:
        """Read ``job`` (one read however many wait for it) and answer whom its version satisfies."""
        if job in self._reading:
            self._again.add(job)
            return
        self._reading.add(job)

        def read(found: Job | None, error: BaseException | None) -> None:
            self._reading.discard(job)
            if isinstance(error, NotFound):  # the job is gone: so is what its waiters wait for
                for waiter in self.waits.take_all(job):
                    self._answer(waiter, None, error)
            elif found is not None:
                for waiter in self.waits.passed(job, found.version):
                    self._answer(waiter, found, None)
            # another error (Redis away): the next event, recheck or deadline tries again
            if job in self._again:
                self._again.discard(job)
                if job in self.waits:
                    self._refresh(job)

        self._read(job, read)

    def _expired(self, waiter: Waiter) -> None:
        if not self.waits.remove(waiter):
            return
        known = self.fresh(waiter.job)
        if known is not None:
            waiter.answer(known, None)
        else:
            self._read(waiter.job, waiter.answer)

    @staticmethod
    def _answer(waiter: Waiter, job: Job | None, error: BaseException | None) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.answer(job, error)
