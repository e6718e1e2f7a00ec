"""Process lifetime helpers shared by the node's processes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable

from lifl.net.io import ready

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: safe to call between fork and exec


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def on_signals(callback: Callable[[], None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Call ``callback`` (in a thread of its own) when one of ``signals`` arrives. Call it from
    the main thread.

    Not from the signal handler: Python runs handlers in the main thread between bytecodes, and
    if that thread is inside ``threading.Event.wait()`` holding the event's lock when the signal
    comes, an ``Event.set()`` in the handler waits for that lock forever: a process that no
    SIGTERM stops. The handlers here do nothing; the kernel-level handler writes the signal to a
    wakeup pipe, which the thread reads."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    for sig in signals:
        signal.signal(sig, lambda *_: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def wait() -> None:
        os.set_blocking(read_end, True)
        while os.read(read_end, 64):
            callback()

    threading.Thread(target=wait, daemon=True, name="signals").start()


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it is still running ``timeout`` seconds later; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_exited(pids: Iterable[int], timeout: float) -> None:
    """Wait until these processes, children of anyone, have exited; SIGKILL those still running
    ``timeout`` seconds from now. A pidfd becomes readable when its process exits: no polling
    of /proc, and a pid reused meanwhile is never mistaken for the process."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone already
            fds.append(os.pidfd_open(pid))
    deadline = time.monotonic() + timeout
    try:
        for fd in fds:
            if not ready([fd], deadline - time.monotonic()):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                ready([fd])  # SIGKILL cannot be ignored: it exits
    finally:
        for fd in fds:
            os.close(fd)
