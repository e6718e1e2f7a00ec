"""Flower on its own deployment engine, running `lifl demo`'s FL job (for `lifl bench compare`).

A SuperLink and a few SuperNodes run as separate processes on loopback (``--insecure``, free
ports, Flower's home in the work directory) and the job is started with ``flwr run`` on the
Flower app in lifl/bench/flowerapp: the same model, split and training code as `lifl demo`
(lifl.workload), ``goal`` clients of the population per round, Flower's FedAvg, the global model
evaluated on the test split after every round. The ServerApp writes each round to a JSON-lines
file; this module times the run from when ``flwr run`` is issued and reads CPU time and peak
memory of both sides' process trees from /proc.

Flower lives in an environment of its own (FLWR_VERSION, made on first use under
~/.cache/lifl): it requires protobuf < 7, and lifl's gRPC stubs are protobuf 7 gencode, so the
two cannot share lifl's .venv. That environment reaches lifl and torch through a .pth file
pointing at this interpreter's site-packages, after its own packages.

What Flower's cost is made of (flwr 1.41, 100 clients, 10 a round, 2 SuperNodes, on 2 loaded
cores: 39 rounds to 90 % in 28 min; the figures below are from that run):
- Clients, not a server property: a SuperNode takes one message at a time and its SuperExec
  starts a new ``flwr-clientapp`` process for every message (its local executor never reuses
  one). Each pays a cold start (Python, flwr, torch: 4.7 s from
  process start to the handler) and torch's lazy imports on the first optimizer step (most of a
  1.9 s "train" whose SGD takes tens of milliseconds): 5.6 CPU-s per message, 94 % of the
  clients' CPU and 86 % of all.
  With 2 cores that makes a round of 10 messages last about 30-40 s; more SuperNodes overlap the
  polls but not the CPU (4 instead of 2: rounds 18 % shorter).
- Polling: the ServerApp polls the SuperLink for replies every 3 s (Grid.send_and_receive), a
  server property that adds up to 3 s to every round; an idle SuperNode polls for messages
  every 3 s, and per message its SuperExec polls for the task every 1 s and the SuperNode for
  the ClientApp's reply every 0.5 s (client side).
- Server: 5.8 CPU-s a round, 87 % of it the SuperLink's HTTP API. Every tensor of the model (and
  each of its chunks and records) is an object moved by a request of its own: about 100 requests
  through the SuperLink per message (a SuperNode pulls ~30 and pushes ~33, the ServerApp pulls
  ~33), each through FastAPI's middleware and a node-signature check. FedAvg itself (all replies
  held in memory, no eager aggregation) takes 19 ms a round; the ServerApp process (torch for
  the model and evaluation: 650 MB of the server's 915 MB peak) about 0.5 CPU-s a round.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifl.procs import die_with_parent

FLWR_VERSION = "1.41.0"
APP_DIR = Path(__file__).with_name("flowerapp")
STARTUP_TIMEOUT_S = 180.0  # bounds a failure only: a loaded machine starts these slowly
STOP_TIMEOUT_S = 15.0
DEADLINE_GRACE_S = 60.0  # the round in flight when the deadline passes, and the ServerApp's exit
SAMPLE_INTERVAL_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK")
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_ROLES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp")


# -- the Flower environment --------------------------------------------------------------------------


def flower_env() -> Path:
    """The bin directory of the Flower environment, made on first use ($LIFL_FLOWER_ENV overrides where)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifl"
    root = Path(os.environ.get("LIFL_FLOWER_ENV") or cache / f"flower-{FLWR_VERSION}")
    root.parent.mkdir(parents=True, exist_ok=True)
    ready = root / ".lifl-ready"
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs make it once
        if not ready.exists():
            shutil.rmtree(root, ignore_errors=True)
            for argv in ([sys.executable, "-m", "venv", str(root)],
                         [str(root / "bin" / "python"), "-m", "pip", "install", "-q", f"flwr=={FLWR_VERSION}"]):
                done = subprocess.run(argv, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"making the Flower environment failed: {' '.join(argv)}\n{done.stdout}{done.stderr}")
            ready.write_text(FLWR_VERSION + "\n")
        # after Flower's own packages: lifl (editable or not) and torch from this environment
        site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        (site / "zz-lifl.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return root / "bin"


# -- processes -----------------------------------------------------------------------------------------


@dataclass
class _Stat:
    comm: str
    ppid: int
    start: int  # clock ticks after boot: with the pid, names a process across samples
    own_s: float  # user + system
    reaped_s: float  # user + system of the children it has waited for


def _scan() -> dict[int, _Stat]:
    """Every process's parent and CPU times, in one pass over /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                head, tail = Path(entry.path, "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            f = tail.split()
            table[int(entry.name)] = _Stat(head.split("(", 1)[1], int(f[1]), int(f[19]), (int(f[11]) + int(f[12])) / _TICK,
                                           (int(f[13]) + int(f[14])) / _TICK)
    return table


def tree(table: dict[int, _Stat], root: int) -> list[int]:
    """``root`` and its descendants (exited ones not yet reaped included), parents first."""
    kids: dict[int, list[int]] = {}
    for pid, s in table.items():
        kids.setdefault(s.ppid, []).append(pid)
    out, todo = [], [root] if root in table else []
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def tree_cpu_s(table: dict[int, _Stat], root: int) -> float:
    """CPU time of a process tree so far: every member's own, plus what members have reaped
    (an exited child's time moves into its parent's when the parent waits for it)."""
    return sum(table[p].own_s + table[p].reaped_s for p in tree(table, root))


def _status_mb(pid: int, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _role(comm: str) -> str:
    """Which Flower program a process runs: its console script names it (truncated to 15 characters);
    "other" for what those start (``uname``, ``ldconfig`` from library look-ups)."""
    return next((r for r in _ROLES if r[:15] == comm), "other")


def runs_of(marker: str) -> list[int]:
    """Processes whose environment holds this run's marker (its work directory): what must not survive it."""
    needle = f"LIFL_FLOWER_RUN={marker}".encode() + b"\0"
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in Path(entry.path, "environ").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that are free now (Flower binds them itself, just after)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _launch(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> _Proc:
    """A Flower daemon in a session of its own (its children join its process group), its output in a log."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir, env=env,
                                 start_new_session=True, preexec_fn=die_with_parent)
    return _Proc(name, popen, log)


def _wait(condition: Callable[[], bool], what: str, procs: list[_Proc], timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait for ``condition``, failing early if one of ``procs`` exits."""
    limit = time.monotonic() + timeout
    while not condition():
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}) while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > limit:
            raise TimeoutError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.1)


@contextmanager
def _subreaper() -> Iterator[None]:
    """Make this process the subreaper of what it starts while the run lasts: the orphans the
    daemons leave when they stop (their SuperExecs, the ServerApp, ClientApps not yet waited
    for) come to it, and it waits for them, rather than to a PID 1 that may never reap them."""
    was = ctypes.c_int()
    _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        _prctl(_PR_SET_CHILD_SUBREAPER, was.value, 0, 0, 0)


def _stop(procs: list[_Proc], marker: str) -> None:
    """Terminate the daemons' process groups (SuperNodes first), kill what outlives the timeout,
    then anything else of this run (a process that left its group), and reap its orphans."""
    for p in procs:
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)  # the group's stragglers, or the daemon itself
        except ProcessLookupError:
            pass
        p.popen.wait()
    limit = time.monotonic() + STOP_TIMEOUT_S
    while pids := runs_of(marker):  # live ones only: an exited process's environment is gone
        if time.monotonic() > limit:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.1)
    for pid, stat in _scan().items():
        if stat.ppid == os.getpid() and stat.comm.startswith(("flower-", "flwr-")):
            try:
                os.waitpid(pid, 0)  # exited: its parent is gone, and every live process of the run too
            except ChildProcessError:
                pass


# -- measuring -----------------------------------------------------------------------------------------


@dataclass
class _Seen:
    """A process of the run, as last sampled."""

    side: str  # "server" or "client"
    role: str  # its Flower program
    cpu_s: float = 0.0  # its own CPU time (a zombie's stays readable until it is reaped)
    peak_mb: float = 0.0  # VmHWM: readable while it runs


@dataclass
class _Monitor:
    """Samples both sides' process trees and reads the ServerApp's events as they come."""

    server: int  # the SuperLink
    clients: list[int]  # the SuperNodes
    events_path: Path
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    client_peak_rss_mb: float = 0.0  # the most resident memory of the client side at one time
    seen: dict[tuple[int, int], _Seen] = field(default_factory=dict)  # by (pid, start)
    live_roles: set[str] = field(default_factory=set)
    events: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0

    def sample(self) -> None:
        table = _scan()
        self.server_cpu_s = tree_cpu_s(table, self.server)
        self.client_cpu_s = sum(tree_cpu_s(table, pid) for pid in self.clients)
        self.live_roles = set()
        client_rss = 0.0
        for side, roots in (("server", [self.server]), ("client", self.clients)):
            for pid in (p for root in roots for p in tree(table, root)):
                key = (pid, table[pid].start)
                seen = self.seen.setdefault(key, _Seen(side, ""))
                seen.role = _role(table[pid].comm)  # again each time: a child is its parent until it execs
                seen.cpu_s = table[pid].own_s
                peak = _status_mb(pid, "VmHWM")
                if peak:
                    self.live_roles.add(seen.role)
                    seen.peak_mb = max(seen.peak_mb, peak)
                    if side == "client":
                        client_rss += _status_mb(pid, "VmRSS")
        self.client_peak_rss_mb = max(self.client_peak_rss_mb, client_rss)

    def read_events(self) -> list[dict[str, Any]]:
        """New complete lines of the events file, each stamped with the server's CPU time now."""
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if new:
            self.sample()
            for e in new:
                e["server_cpu_s"] = self.server_cpu_s
            self.events += new
        return new

    def by_role(self, side: str, what: str) -> dict[str, float]:
        """CPU seconds or peak MB (``what``: "cpu_s" or "peak_mb") of one side, summed per Flower program."""
        out: dict[str, float] = {}
        for seen in self.seen.values():
            if seen.side == side:
                out[seen.role] = out.get(seen.role, 0.0) + getattr(seen, what)
        if side == "server" and what == "peak_mb":  # the ServerApp's own count reaches to its exit
            out["flwr-serverapp"] = max([out.get("flwr-serverapp", 0.0)] + [e.get("maxrss_mb", 0.0) for e in self.events])
        return {k: round(v, 1) for k, v in sorted(out.items())}


def summarize(events: list[dict[str, Any]], t_run: float, target: float) -> dict[str, Any]:
    """Time to accuracy, rounds and the round series from the ServerApp's events (times from ``flwr run``)."""
    rounds = [e for e in events if e["event"] == "round"]
    reached = next((e for e in rounds if e["accuracy"] >= target), None)
    trained = [e for e in rounds if e["round"] > 0]
    starts = {e["round"]: e["t"] for e in events if e["event"] == "round_start"}
    first = min(starts.values(), default=None)

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    return {
        "reached": reached is not None,
        "time_to_accuracy_s": round(reached["t"] - t_run, 2) if reached else None,
        "rounds": len(trained),
        "final_accuracy": round(rounds[-1]["accuracy"], 4) if rounds else 0.0,
        "first_round_t": first,
        "round_s_mean": mean([e["t"] - starts[e["round"]] for e in trained if e["round"] in starts]),
        "send_receive_s_mean": mean([e["send_receive_s"] for e in trained]),
        "aggregate_s_mean": mean([e["aggregate_s"] for e in trained]),
        "clientapp_s_mean": {k: mean([e["clients"][k] for e in trained if k in e.get("clients", {})])
                             for k in ("startup_s", "data_s", "train_s")},
        "messages": sum(e.get("replies", 0) + e.get("failures", 0) for e in trained),
        "series": [{"t": round(e["t"] - t_run, 2), "round": e["round"], "accuracy": round(e["accuracy"], 4),
                    "server_cpu_s": round(e["server_cpu_s"], 2)} for e in rounds],
    }


def save_split(path: Path, clients: int, alpha: float, seed: int) -> Path:
    """lifl.workload's split as the apps read it: each client's partition (``x<i>``, ``y<i>``) and
    the test split, made once here as `lifl demo`'s harness does, not in every ClientApp."""
    import numpy as np

    from lifl.workload import load_digits_split

    digits = load_digits_split(clients, alpha, seed)
    parts = {f"{k}{i}": a for i, (x, y) in enumerate(digits.clients) for k, a in (("x", x), ("y", y))}
    np.savez(path, test_x=digits.test[0], test_y=digits.test[1], **parts)
    return path


def _toml_value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else repr(v)


# -- the run -------------------------------------------------------------------------------------------


def run_flower(*, target: float = 0.9, clients: int = 100, goal: int = 10, alpha: float = 0.5, seed: int = 0,
               max_minutes: float = 9.0, workdir: Path, supernodes: int = 2, log: bool = False, max_rounds: int = 1000,
               lifl_gateway: str = "", lifl_token: str | None = None) -> dict[str, Any]:
    """Train `lifl demo`'s job on Flower's deployment engine until ``target`` test accuracy,
    ``max_rounds`` or ``max_minutes`` after ``flwr run``; every process is stopped before it returns
    or raises. With ``lifl_gateway`` the ServerApp aggregates through lifl.flower.LiflFedAvg in the
    lifl node there, presenting ``lifl_token`` (default: $LIFL_TOKEN)."""
    bin_dir = flower_env()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    app = workdir / "app"  # flwr run reads (and may migrate) the app's pyproject.toml: a copy, not the package
    shutil.rmtree(app, ignore_errors=True)
    shutil.copytree(APP_DIR, app, ignore=shutil.ignore_patterns("__pycache__"))
    home = workdir / "flwr-home"
    home.mkdir(exist_ok=True)
    link_port, *node_ports = free_ports(1 + supernodes)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "lifl"\n\n[superlink.lifl]\naddress = "127.0.0.1:{link_port}"\n'
                                      "insecure = true\n")
    marker = str(workdir)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_HOME": str(home),
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PYTHONUNBUFFERED": "1", "LIFL_FLOWER_RUN": marker}
    if lifl_token is not None:
        env["LIFL_TOKEN"] = lifl_token  # the environment, not the run config: Flower keeps that with the run
    env.pop("VIRTUAL_ENV", None)
    events_path = workdir / "events.jsonl"
    events_path.unlink(missing_ok=True)
    data = save_split(workdir / "digits.npz", clients, alpha, seed)
    procs: list[_Proc] = []
    say = (lambda msg: print(f"flower: {msg}", file=sys.stderr, flush=True)) if log else (lambda msg: None)
    with _subreaper():
        try:
            t_launch = time.time()
            superlink = _launch("superlink", [str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                              "--port", str(link_port), "--disable-runtime-dependency-installation"], workdir, env)
            procs.append(superlink)
            _wait(lambda: _listening(link_port), "SuperLink listening", procs)
            nodes: list[_Proc] = []
            for i, port in enumerate(node_ports):
                argv = [str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                        "--host", "127.0.0.1", "--port", str(port)]
                nodes.append(_launch(f"supernode-{i}", argv, workdir, env))
                procs.insert(0, nodes[-1])  # SuperNodes are stopped first
            _wait(lambda: all("SuperNode ID:" in p.log.read_text(errors="replace") for p in nodes), "SuperNodes registered", procs)
            t_infra = time.time()
            say(f"SuperLink and {supernodes} SuperNodes up in {t_infra - t_launch:.1f} s")
            monitor = _Monitor(superlink.popen.pid, [p.popen.pid for p in nodes], events_path)
            monitor.sample()
            run_config = {"clients": clients, "goal": goal, "seed": seed, "target": target, "min-nodes": supernodes,
                          "data": str(data), "events": str(events_path), "max-rounds": max_rounds, "lifl-gateway": lifl_gateway}
            config_file = workdir / "run-config.toml"
            t_run = time.time()
            run_config["deadline"] = t_run + max_minutes * 60
            config_file.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
            server_cpu_at_run = monitor.server_cpu_s
            cli_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
            cli = subprocess.run([str(bin_dir / "flwr"), "run", str(app), "lifl", "--run-config", str(config_file), "--format", "json"],
                                 cwd=workdir, env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
            cli_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            (workdir / "flwr-run.log").write_text(cli.stdout + cli.stderr)
            if cli.returncode:
                raise RuntimeError(f"flwr run failed ({cli.returncode}):\n{cli.stdout}{cli.stderr}")
            t_cli = time.time()
            say(f"flwr run returned in {t_cli - t_run:.1f} s")
            limit = run_config["deadline"] + DEADLINE_GRACE_S
            serverapp_seen, serverapp_gone, next_sample = False, 0.0, 0.0
            while True:
                for e in monitor.read_events():
                    if e["event"] == "round":
                        say(f"round {e['round']}: accuracy {e['accuracy']:.3f} at {e['t'] - t_run:.1f} s")
                if failed := next((e for e in monitor.events if e["event"] == "failed"), None):
                    raise RuntimeError(f"the ServerApp failed: {failed['error']}\n{superlink.tail()}")
                if any(e["event"] == "done" for e in monitor.events):
                    break
                if time.monotonic() >= next_sample:
                    monitor.sample()
                    next_sample = time.monotonic() + SAMPLE_INTERVAL_S
                    if "flwr-serverapp" in monitor.live_roles:
                        serverapp_seen, serverapp_gone = True, 0.0
                    elif serverapp_seen:
                        serverapp_gone = serverapp_gone or time.monotonic()
                        if time.monotonic() - serverapp_gone > 5.0:  # time for its last lines to arrive
                            raise RuntimeError(f"the ServerApp exited before finishing:\n{superlink.tail()}")
                for p in procs:
                    if p.popen.poll() is not None:
                        raise RuntimeError(f"{p.name} exited ({p.popen.returncode}) during the run:\n{p.tail()}")
                if time.time() > limit:
                    say("the ServerApp did not finish in time: stopping")
                    break
                time.sleep(0.1)
            monitor.sample()
            t_end = time.time()
        finally:
            _stop(procs, marker)
    s = summarize(monitor.events, t_run, target)
    last = next((e for e in reversed(monitor.events) if e["event"] == "round" and e["round"] > 0), None)
    reached = next((e for e in monitor.events if e["event"] == "round" and e["accuracy"] >= target), None)
    peaks = monitor.by_role("server", "peak_mb")
    return {
        "system": "flower+lifl" if lifl_gateway else "flower",
        "flwr_version": FLWR_VERSION,
        "target_accuracy": target,
        "reached": s["reached"],
        "time_to_accuracy_s": s["time_to_accuracy_s"],
        "rounds": s["rounds"],
        "final_accuracy": s["final_accuracy"],
        "aggregation_cpu_s": round(monitor.server_cpu_s, 2),
        "server_cpu_to_accuracy_s": round(reached["server_cpu_s"], 2) if reached else None,
        "server_cpu_s_per_round": round((last["server_cpu_s"] - server_cpu_at_run) / s["rounds"], 3) if last else 0.0,
        "server_peak_memory_mb": round(sum(peaks.values()), 1),
        "server_peak_memory_by_program_mb": peaks,
        "server_cpu_by_program_s": monitor.by_role("server", "cpu_s"),
        "client_cpu_s": round(monitor.client_cpu_s, 2),
        "client_cpu_by_program_s": monitor.by_role("client", "cpu_s"),
        "client_peak_rss_mb": round(monitor.client_peak_rss_mb, 1),
        "startup_s": round(s["first_round_t"] - t_launch, 2) if s["first_round_t"] else None,
        "infra_startup_s": round(t_infra - t_launch, 2),
        "run_startup_s": round(s["first_round_t"] - t_run, 2) if s["first_round_t"] else None,
        "flwr_run_cli": {"wall_s": round(t_cli - t_run, 2),
                         "cpu_s": round(cli_after.ru_utime + cli_after.ru_stime - cli_cpu.ru_utime - cli_cpu.ru_stime, 2)},
        "wall_s": round(t_end - t_run, 2),
        "round_s_mean": s["round_s_mean"],
        "send_receive_s_mean": s["send_receive_s_mean"],
        "aggregate_s_mean": s["aggregate_s_mean"],
        "clientapp_s_mean": s["clientapp_s_mean"],
        "clientapp_processes": s["messages"],
        "setup": {"model": "cnn", "clients": clients, "goal": goal, "alpha": alpha, "seed": seed, "supernodes": supernodes,
                  "max_minutes": max_minutes},
        "series": s["series"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lifl.bench.flower", description="lifl demo's FL job on Flower's deployment engine")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--goal", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=9.0)
    p.add_argument("--supernodes", type=int, default=2)
    p.add_argument("--max-rounds", type=int, default=1000)
    p.add_argument("--lifl-gateway", default="", help="aggregate in the lifl node at this gateway (host:port, token: $LIFL_TOKEN) "
                                                      "with lifl.flower.LiflFedAvg instead of Flower's FedAvg")
    p.add_argument("--workdir", type=Path, help="keep logs and events here (default: a temporary directory, removed)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the run's processes first
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lifl-flower-"))
    try:
        result = run_flower(target=args.target, clients=args.clients, goal=args.goal, alpha=args.alpha, seed=args.seed,
                            max_minutes=args.max_minutes, workdir=workdir, supernodes=args.supernodes, log=not args.json,
                            max_rounds=args.max_rounds, lifl_gateway=args.lifl_gateway)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if k != "series":
                print(f"{k:34} {v}")


if __name__ == "__main__":
    main()
