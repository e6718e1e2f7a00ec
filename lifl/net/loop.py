"""One thread's event loop: sockets, timers, callables posted from other threads, and work that
blocks run on small bounded pools whose results come back to the loop.

A node's processes are built on it: the agent owns all of its state from its loop's thread (no
lock guards that state, because no other thread touches it), and the gateway serves every
connection from its loop. Underneath it is ``selectors`` (epoll on Linux); asyncio would add a
future and a handle per callback for nothing these processes use.

- ``watch(fileobj, reader, writer)``: call ``reader()`` when it is readable, ``writer()`` when it is
  writable (either may be None); ``unwatch`` forgets it.
- ``later(delay, fn)``: a timer (``cancel`` it), ``every(name, period, fn)``: a periodic duty,
  which logs its failures and runs again on its next period.
- ``post(fn)``: from any thread, ``fn`` runs on the loop soon; ``call(fn)``: from another thread,
  run ``fn`` on the loop and wait for its result (its exception is raised in the caller).
- ``offload(fn, done, pool=...)``: run ``fn`` (which blocks: Redis, disks, processes) on a pool,
  then ``done(result, error)`` on the loop. Each pool has a fixed number of threads
  (``POOL_THREADS`` unless the loop is given others); work beyond them waits its turn.
  ``start_pools`` creates them all at once (by default each is made when first needed).

Callbacks must not block: whatever may, goes through ``offload``.
"""

from __future__ import annotations

import heapq
import itertools
import os
import selectors
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Done = Callable[[Any, BaseException | None], None]

IO_POOL = "io"  # short calls that block: Redis, small files
SLOW_POOL = "slow"  # long ones (queries' inputs, strategy inputs, checkpoints read back)
POOL_THREADS = {IO_POOL: 4, SLOW_POOL: 4}


class Timer:
    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    def __init__(self, name: str, pools: dict[str, int] | None = None) -> None:
        self.name = name
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, (self._woken, None))
        self._watching: dict[int, tuple[int, Any, Any]] = {}  # fd -> what is watched (the loop's own fds aside)
        self._posted: deque[Callable[[], None]] = deque()
        self._signalled = False
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._pool_sizes = dict(pools or POOL_THREADS)
        self._pools = {pool: ThreadPoolExecutor(n, thread_name_prefix=f"{name}-{pool}") for pool, n in self._pool_sizes.items()}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._closed = False

    # -- readiness -----------------------------------------------------------------------------
    def watch(self, fileobj: Any, reader: Callable[[], None] | None, writer: Callable[[], None] | None = None) -> None:
        """Call ``reader`` when ``fileobj`` is readable and ``writer`` when writable (None: not
        that); calling it again changes what is watched. Unwatch a file before closing it."""
        events = (selectors.EVENT_READ if reader else 0) | (selectors.EVENT_WRITE if writer else 0)
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        current = self._watching.get(fd)  # not the selector's get_key: its miss formats the file's repr
        if current is None:
            if events:
                self._selector.register(fileobj, events, (reader, writer))
                self._watching[fd] = (events, reader, writer)
            return
        if not events:
            self._selector.unregister(fileobj)
            del self._watching[fd]
        elif current != (events, reader, writer):
            self._selector.modify(fileobj, events, (reader, writer))
            self._watching[fd] = (events, reader, writer)

    def unwatch(self, fileobj: Any) -> None:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        if fd >= 0 and fd not in self._watching:
            return  # (a closed file has no fd: the selector finds it by identity)
        try:
            key = self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            return
        self._watching.pop(key.fd, None)

    # -- time ------------------------------------------------------------------------------------
    def later(self, delay: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(time.monotonic() + delay, fn)
        heapq.heappush(self._timers, (timer.when, next(self._seq), timer))
        return timer

    def every(self, name: str, period: float, fn: Callable[[], None]) -> Timer:
        """A periodic duty: ``fn`` runs every ``period`` seconds; an exception is logged (once per
        kind in a row, so an outage does not flood the log) and the next period runs it again."""
        last_error: list[str] = [""]

        def tick() -> None:
            try:
                fn()
                last_error[0] = ""
            except Exception as e:
                kind = type(e).__name__
                if kind != last_error[0]:
                    print(f"{self.name}: {name} failed ({kind}: {e}); it runs again every {period:g} s", file=sys.stderr)
                    if not hasattr(e, "code"):  # not one of lifl's errors: a bug, show where
                        traceback.print_exc()
                last_error[0] = kind
            finally:
                timer.when = time.monotonic() + period
                if not timer.cancelled:
                    heapq.heappush(self._timers, (timer.when, next(self._seq), timer))

        timer = Timer(time.monotonic() + period, tick)
        heapq.heappush(self._timers, (timer.when, next(self._seq), timer))
        return timer

    # -- other threads ---------------------------------------------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop soon (thread-safe); after ``close``, never."""
        if self._closed:
            return  # a pool's late completion: nobody is left to run it
        self._posted.append(fn)
        if self._thread is threading.current_thread():
            return  # the loop runs what was posted before it waits again: no wake-up needed
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """From a thread other than the loop's: ``fn()`` run on the loop; its result, or its
        exception. Once the loop has stopped nothing else runs there: ``fn`` runs here."""
        if self.in_loop() or not self.running:
            return fn()
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

        self.post(run)
        return future.result(timeout)

    def offload(self, fn: Callable[[], T], done: Done, pool: str = IO_POOL) -> None:
        """Run ``fn`` on ``pool``; then ``done(result, None)`` or ``done(None, error)`` on the loop."""

        def work() -> None:
            try:
                result = fn()
            except BaseException as e:  # the loop decides what it means
                error = e
                self.post(lambda: done(None, error))
                return
            self.post(lambda: done(result, None))

        try:
            self._pools[pool].submit(work)
        except RuntimeError as e:  # shut down: nothing will run it
            done(None, e)

    def in_loop(self) -> bool:
        return self._thread is threading.current_thread()

    @property
    def running(self) -> bool:
        """Whether ``run`` has started (on some thread), and neither ended nor been stopped."""
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def start_pools(self) -> None:
        """Create every pool's threads now, so that the process's threads are a fixed set from
        here on (each waits at a barrier until all of its pool's are up)."""
        for pool, size in self._pool_sizes.items():
            barrier = threading.Barrier(size + 1)
            for _ in range(size):
                self._pools[pool].submit(barrier.wait)
            barrier.wait()

    # -- running ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stop``; on the calling thread, which becomes the loop's."""
        self._thread = threading.current_thread()
        select = self._selector.select
        while not self._stopped:
            timeout = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            if self._posted:
                timeout = 0.0
            for key, mask in select(timeout):
                reader, writer = key.data
                if mask & selectors.EVENT_READ and reader is not None:
                    self._guarded(reader)
                if mask & selectors.EVENT_WRITE and writer is not None:
                    self._guarded(writer)
            self._run_posted()
            self._run_timers()

    def start(self) -> threading.Thread:
        """Run the loop on a thread of its own."""
        thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        thread.start()
        while self._thread is None:
            time.sleep(0.001)
        return thread

    def stop(self) -> None:
        """End ``run`` (from any thread); work offloaded already still completes."""
        self.post(self._halt)

    def close(self) -> None:
        """After ``stop``: end the pools (work under way finishes, its completion is dropped)."""
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _halt(self) -> None:
        self._stopped = True

    def _woken(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._signalled = False  # before draining: a post after this point writes again

    def _run_posted(self) -> None:
        for _ in range(len(self._posted)):
            self._guarded(self._posted.popleft())

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled and timer.when == when:
                self._guarded(timer.fn)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug in one callback must not stop the process's loop
            print(f"{self.name}: a callback failed", file=sys.stderr)
            traceback.print_exc()
