"""`lifl up --system sf|sf-micro|sl`: a baseline system on this machine, for comparisons.

Each is a set of real processes around a redis-server of its own (job state, and for SF-micro
and SL the message broker: Redis streams, kept in memory without persistence, which only
helps the baselines):

- ``sf`` (SF-mono): the frontend, which is also the always-on leaf aggregator with its
  in-memory queue; the always-on top aggregator; a gRPC channel from leaf to top;
- ``sf-micro``: the frontend, which puts updates in the broker; an always-on stateless leaf
  that consumes them; the top, over gRPC;
- ``sl``: the frontend, which puts updates in the broker; the dispatcher (trigger, activator
  and KPA autoscaler) which starts function instances, each a function and its sidecar.

All serve the client SDK's calls (``lifl.baselines.frontend``) on ``--http``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis

from lifl import procstat
from lifl.baselines.aggregate import MAX_BATCH_INPUTS
from lifl.baselines.serverless import DEFAULT_FAN_IN
from lifl.node.supervisor import Child
from lifl.procs import on_signals, wait_exited

SYSTEMS = ("lifl", "sf", "sf-micro", "sl")
BASELINES = SYSTEMS[1:]
DEFAULT_KPA_SCALE = 0.1  # KPA's 60 s stable window would outlast a whole comparison run
STOP_TIMEOUT_S = 30.0  # how long stop() lets the processes of the system exit before it kills them


@dataclass
class BaselineConfig:
    system: str
    http: str = "127.0.0.1:8080"
    fan_in: int = DEFAULT_FAN_IN  # sl: updates per leaf invocation
    kpa_scale: float = DEFAULT_KPA_SCALE  # sl

    def __post_init__(self) -> None:
        if self.system not in BASELINES:
            raise ValueError(f"a baseline system is one of {', '.join(BASELINES)}, not {self.system!r}")
        if not 0 < self.kpa_scale <= 10:
            raise ValueError(f"the KPA scale must be in (0, 10], got {self.kpa_scale}")
        if not 1 <= self.fan_in <= MAX_BATCH_INPUTS:
            raise ValueError(f"the fan-in must be in [1, {MAX_BATCH_INPUTS}], got {self.fan_in}")


class BaselineSystem:
    def __init__(self, config: BaselineConfig, log: IO[str] = sys.stdout) -> None:
        self.config = config
        self.log = log
        self.children: dict[str, Child] = {}
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"lifl-{config.system}-"))
        self.redis_url = f"unix://{self.run_dir / 'redis.sock'}"
        self.http = ""

    def _start(self, name: str, argv: list[str], ready: str | None) -> str:
        child = self.children[name] = Child(name, argv, ready, self.log, pdeathsig=True)
        child.start()
        return child.ready_line.rsplit(" ", 1)[-1]

    def start(self) -> str:
        """Start every process; returns the frontend's HTTP address."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("lifl: redis-server is not installed (run `make install`)")
        try:
            self._start("redis", [exe, "--port", "0", "--unixsocket", str(self.run_dir / "redis.sock"), "--unixsocketperm", "700",
                                  "--save", "", "--appendonly", "no", "--dir", str(self.run_dir),
                                  "--logfile", str(self.run_dir / "redis.log")], None)
            self._wait_redis()
            py = [sys.executable, "-m"]
            frontend = [*py, "lifl.baselines.frontend", "--http", self.config.http, "--redis", self.redis_url]
            if self.config.system in ("sf", "sf-micro"):
                top = self._start("top", [*py, "lifl.baselines.serverful", "top", "--redis", self.redis_url], "top listening on ")
                if self.config.system == "sf":
                    frontend += ["--sink", "leaf", "--top", top]
                else:
                    self._start("leaf", [*py, "lifl.baselines.serverful", "leaf", "--redis", self.redis_url, "--top", top],
                                "leaf consuming")
                    frontend += ["--sink", "broker"]
            else:
                self.dispatcher = self._start("dispatcher", [*py, "lifl.baselines.serverless", "dispatcher", "--redis", self.redis_url,
                                                             "--fan-in", str(self.config.fan_in), "--kpa-scale",
                                                             str(self.config.kpa_scale)], "dispatcher listening on ")
                frontend += ["--sink", "broker"]
            self.http = self._start("frontend", frontend, "frontend listening on ")
        except BaseException:
            self.stop()
            raise
        return self.http

    def _wait_redis(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        for _ in range(300):
            try:
                client.ping()
                return
            except redis.RedisError:
                threading.Event().wait(0.05)
        raise RuntimeError("the baseline's redis-server does not answer")

    def _pid(self, name: str) -> list[int]:
        child = self.children.get(name)
        return [child.proc.pid] if child and child.proc and child.proc.poll() is None else []

    def pids(self) -> dict[str, list[int]]:
        """The system's processes by role. ``aggregators`` are those that aggregate (SF-mono's
        frontend among them); SL's function instances are the dispatcher's children."""
        instances = [pid for d in self._pid("dispatcher") for pid in procstat.children(d)]
        functions = [pid for pid in instances if b"function" in _cmdline(pid)]
        return {
            "frontend": self._pid("frontend"),
            "aggregators": (self._pid("frontend") if self.config.system == "sf" else []) + self._pid("leaf")
            + self._pid("top") + functions,
            "sidecars": [pid for pid in instances if pid not in functions],
            "broker": self._pid("redis") + self._pid("dispatcher"),
        }

    def all_pids(self) -> list[int]:
        """Every live process of the system, once."""
        return sorted({pid for group in self.pids().values() for pid in group})

    def stop(self) -> None:
        """Stop every process; when it returns none is running, the dispatcher's function
        instances and sidecars included (they exit as their parent does, not with it)."""
        pids = self.all_pids()
        for name in ("frontend", "dispatcher", "leaf", "top", "redis"):
            child = self.children.get(name)
            if child:
                child.stop()
        wait_exited(pids, STOP_TIMEOUT_S)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def run(config: BaselineConfig) -> int:
    """`lifl up --system X`: start, print the address, run until Ctrl-C or SIGTERM."""
    system = BaselineSystem(config)
    stop = threading.Event()
    on_signals(stop.set)
    address = system.start()
    print(f"lifl baseline {config.system} is up\n  http: http://{address}\n  (a comparison baseline: no tokens, "
          f"leases or gRPC API; see docs/compare.md)", flush=True)
    try:
        while not stop.wait(0.5):
            dead = [name for name, c in system.children.items() if c.proc is not None and c.proc.poll() is not None]
            if dead:
                print(f"lifl: {', '.join(dead)} of the {config.system} baseline exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        system.stop()
        print(f"lifl baseline {config.system} stopped", flush=True)
