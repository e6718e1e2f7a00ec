"""lifl.procs: a stop signal always stops a process, even one that spends its time in Event.wait(); waiting for
processes that are not our children."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys

import pytest

from conftest import wait_for
from lifl.net.io import ready
from lifl.procs import wait_exited

WAITER = """
import threading
from lifl.procs import on_signals
stop = threading.Event()
on_signals(stop.set)
print("ready", flush=True)
while not stop.wait(0.0001):  # the main thread is inside Event.wait() nearly all the time
    pass
print("stopped", flush=True)
"""


def test_a_signal_stops_a_process_waiting_on_an_event() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT) * 5:
        proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(sig)
            wait_for(lambda: proc.poll() is not None, timeout=60, what="the process to stop")
            assert proc.returncode == 0 and proc.stdout.read().strip() == "stopped"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_wait_exited_waits_for_an_exit_and_kills_what_outlives_its_timeout() -> None:
    quick = subprocess.Popen(["sleep", "0.2"])
    stuck = subprocess.Popen(["sleep", "600"])
    wait_exited([quick.pid], timeout=60)  # it ends on its own well within it
    assert quick.wait(5) == 0
    wait_exited([stuck.pid], timeout=0)
    assert stuck.wait(5) == -signal.SIGKILL
    wait_exited([quick.pid], timeout=0)  # reaped and gone: nothing to wait for


def test_waits_work_with_descriptors_past_1024() -> None:
    """A node's processes hold thousands of descriptors (one per object); select() refuses any
    past 1024, so every blocking wait polls."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"descriptors past 1024 need a higher hard limit than {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    reader, writer = (_renumbered(s, fd) for s, fd in zip(socket.socketpair(), (1500, 1501)))
    try:
        assert ready([reader], 0) == [] and ready([writer], 0, write=True) == [writer]
        writer.send(b"x")
        assert ready([reader, writer.fileno()], 60) == [reader]
        held = [os.dup(0) for _ in range(1100)]  # the pidfd below is numbered past 1024 too
        try:
            stuck = subprocess.Popen(["sleep", "600"])
            wait_exited([stuck.pid], timeout=0)
            assert stuck.wait(5) == -signal.SIGKILL
        finally:
            for fd in held:
                os.close(fd)
    finally:
        reader.close()
        writer.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _renumbered(sock: socket.socket, fd: int) -> socket.socket:
    os.dup2(sock.fileno(), fd)
    sock.close()
    return socket.socket(fileno=fd)
