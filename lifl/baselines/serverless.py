"""SL, the stock-serverless baseline (FedKeeper, AdaFed; as on Knative): aggregators are
functions, each instance behind a sidecar proxy, with a message broker between them.

- ``function``: an instance's aggregator, an HTTP server. An invocation's body is a batch of
  inputs; it aggregates them all at once (lazy: it is invoked only when the whole batch is in
  the broker) and answers a leaf's partial sum in its response, or, at the top, installs the
  average as the next version.
- ``sidecar``: a separate process in front of every instance (Knative's queue-proxy) through
  which each request and response passes, relayed in ``RELAY_CHUNK`` pieces; it counts the
  instance's in-flight requests, which the autoscaler scrapes (``GET /_/stats``).
- ``dispatcher``: the broker's trigger, the activator and the autoscaler in one process. It
  follows the broker's announcements; once ``fan_in`` updates of a round are in the broker
  (or the round's last ones), it reads them and invokes a leaf; each leaf's partial goes back
  to the broker, and once a round's partials are all there the top is invoked with them.
  Requests go to the ready instance with the fewest in flight (least connection) and wait,
  counted as load, while none is ready. Instances are started (cold starts: a new function
  and sidecar process, ready once a health check passes through the sidecar) and stopped by
  Knative's KPA (``lifl.baselines.kpa``) from the scraped concurrency, every tick.

Short runs scale KPA's windows by ``--kpa-scale`` (0.1: stable window 6 s, panic window
0.6 s, tick 0.2 s, scale-to-zero grace 3 s); the concurrency target stays Knative's 100 x 0.7.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import queue
import sys
import threading
import time
import urllib.parse
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from lifl.baselines import httpd
from lifl.baselines.aggregate import MAX_BATCH_INPUTS, Aggregation, Input, frame, unframe
from lifl.baselines.broker import PARTIALS, UPDATES, Broker
from lifl.baselines.jobs import Jobs
from lifl.baselines.kpa import Kpa, KpaConfig
from lifl.errors import BadRequest, NotFound
from lifl.node.supervisor import Child
from lifl.procs import die_with_parent, on_signals

MAX_BATCH_BYTES = 8 << 30  # a batch of updates (or partials) in one invocation
RELAY_CHUNK = 1 << 20
INVOKE_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 60.0
DEFAULT_FAN_IN = 5  # updates per leaf invocation (AdaFed's fixed fan-in)
MAX_INVOCATIONS = 64  # invocations in flight at once, across instances


# -- the function -------------------------------------------------------------------------------


def _query(path: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).items()}


def function_handler(jobs: Jobs) -> type[httpd.Handler]:
    class FunctionHandler(httpd.Handler):
        def do_GET(self) -> None:
            self.guarded(lambda: self.send_json(200, {"ready": True}) if self.path == "/healthz"
                         else self.send_error_of(NotFound(f"GET {self.path[:200]} is not served", code="no_route")))

        def do_POST(self) -> None:
            self.guarded(self.invoke)

        def invoke(self) -> None:
            q = _query(self.path)
            job, role = q.get("job", ""), q.get("role", "")
            if role not in ("leaf", "top") or not q.get("version", "").isdigit():
                raise BadRequest("an invocation names job, version and role (leaf or top)", code="bad_invocation")
            body = self.read_body()
            received_at = time.time()
            started = float(q.get("started", received_at))
            items = list(unframe(body))
            if not items:
                raise BadRequest("an invocation carries at least one input", code="bad_batch")
            if role == "leaf":
                jobs.mark_taken(job, sum(i.updates for i in items))
            agg = Aggregation(jobs.spec(job), len(items))
            try:
                agg.offer(items)  # lazy: every input is here; one pass folds them all
                stamps = {"X-Lifl-Received-At": repr(received_at)}
                if role == "leaf":
                    result = agg.result()
                    stamps["X-Lifl-Sent-At"] = repr(time.time())
                    self.send_parts(200, frame([result]), "application/octet-stream", stamps)
                else:
                    model, total = agg.model()
                    installed = jobs.install(job, int(q["version"]), model, total.samples, total.updates, started)
                    self.send_json(200, {"installed": installed, "updates": total.updates}, stamps)
            finally:
                agg.close()

    return FunctionHandler


# -- the sidecar --------------------------------------------------------------------------------

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "content-length"}


@dataclass
class SidecarStats:
    in_flight: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def sidecar_handler(target: str, stats: SidecarStats) -> type[httpd.Handler]:
    host, port = target.rsplit(":", 1)
    local = threading.local()

    class SidecarHandler(httpd.Handler):
        def upstream(self) -> http.client.HTTPConnection:
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(host, int(port), timeout=INVOKE_TIMEOUT_S)
            return conn

        def relay(self, size: int, read_into: Any, write: Any) -> None:
            buffer = memoryview(bytearray(min(size, RELAY_CHUNK) or 1))
            left = size
            while left:
                n = read_into(buffer[: min(left, len(buffer))])
                if not n:
                    raise BadRequest(f"body ended with {left} of {size} bytes missing", code="truncated")
                write(buffer[:n])
                left -= n

        def proxy(self) -> None:
            size = self.body_length() if self.command in ("POST", "PUT") else 0
            with stats.lock:
                stats.in_flight += 1
                stats.requests += 1
            try:
                conn = self.upstream()
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP_BY_HOP:
                            conn.putheader(name, value)
                    conn.putheader("Content-Length", str(size))
                    conn.endheaders()
                    assert conn.sock is not None
                    self.relay(size, self.rfile.readinto, conn.sock.sendall)
                    response = conn.getresponse()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    raise
                length = int(response.getheader("Content-Length") or 0)
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.relay(length, response.readinto, self.wfile.write)
                if response.will_close:
                    conn.close()
            finally:
                with stats.lock:
                    stats.in_flight -= 1

        def do_GET(self) -> None:
            if self.path == "/_/stats":
                with stats.lock:
                    self.send_json(200, {"concurrency": stats.in_flight, "requests": stats.requests})
                return
            self.guarded(self.proxy)

        def do_POST(self) -> None:
            self.guarded(self.proxy)

    return SidecarHandler


# -- the dispatcher: trigger, activator, autoscaler ---------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    send_cpu_s: float  # this thread's CPU sending the request
    receive_cpu_s: float  # and receiving the reply (waiting for it costs none)
    received_at: float  # wall clock when the body was in


def post(address: str, path: str, parts: list[Any], timeout: float = INVOKE_TIMEOUT_S) -> Reply:
    """POST a body given as parts (a gathered write: no copy into one buffer)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        start = time.thread_time()
        conn.putrequest("POST", path, skip_accept_encoding=True)
        conn.putheader("Content-Length", str(sum(len(p) for p in parts)))
        conn.endheaders()
        assert conn.sock is not None
        for part in parts:
            conn.sock.sendall(part)
        sent = time.thread_time()
        response = conn.getresponse()
        answered = time.thread_time()
        body = response.read()
        return Reply(response.status, dict(response.getheaders()), body, sent - start, time.thread_time() - answered, time.time())
    finally:
        conn.close()


def get_json(address: str, path: str, timeout: float = 5.0) -> Any:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET {path} answered {response.status}")
        return json.loads(body)
    finally:
        conn.close()


class Instance:
    """A function instance: its aggregator process and its sidecar."""

    def __init__(self, number: int, redis_url: str, log: Any) -> None:
        self.number = number
        self.in_flight = 0
        self.started = time.monotonic()
        self.cold_start_s = math.nan
        py = [sys.executable, "-m", "lifl.baselines.serverless"]
        self.function = Child(f"function-{number}", [*py, "function", "--redis", redis_url], "function listening on ", log,
                              pdeathsig=True)
        self.function.start(READY_TIMEOUT_S)
        target = self.function.ready_line.rsplit(" ", 1)[1]
        self.sidecar = Child(f"sidecar-{number}", [*py, "sidecar", "--target", target], "sidecar listening on ", log,
                             pdeathsig=True)
        self.sidecar.start(READY_TIMEOUT_S)
        self.address = self.sidecar.ready_line.rsplit(" ", 1)[1]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # the readiness probe goes through the sidecar, as the kubelet's does
            try:
                get_json(self.address, "/healthz")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"instance {number} did not become ready") from None
                time.sleep(0.01)
        self.cold_start_s = time.monotonic() - self.started

    def pids(self) -> list[int]:
        return [c.proc.pid for c in (self.function, self.sidecar) if c.proc is not None and c.proc.poll() is None]

    def stop(self) -> None:
        self.sidecar.stop()
        self.function.stop()


class Pool:
    """Instances and the requests waiting for one (the activator's buffer)."""

    def __init__(self, redis_url: str, log: Any) -> None:
        self.redis_url = redis_url
        self.log = log
        self.ready: list[Instance] = []
        self.starting = 0
        self.waiting = 0
        self.started_total = 0
        self.cold_starts_s: list[float] = []
        self._numbers = 0
        self._cond = threading.Condition()
        # Instances are started from one long-lived thread: their parent-death signal fires when
        # the thread that started them ends, not only the process.
        self._starts: queue.SimpleQueue[None] = queue.SimpleQueue()
        threading.Thread(target=self._starter, daemon=True).start()

    def _starter(self) -> None:
        while True:
            self._starts.get()
            self._start_one()

    def start(self, count: int) -> None:
        """Start ``count`` more instances (cold starts), one after the other."""
        with self._cond:
            self.starting += count
        for _ in range(count):
            self._starts.put(None)

    def acquire(self, timeout: float = INVOKE_TIMEOUT_S) -> Instance:
        """The ready instance with the fewest requests in flight (least connection)."""
        with self._cond:
            self.waiting += 1
            try:
                if not self._cond.wait_for(lambda: self.ready, timeout):
                    raise TimeoutError("no function instance became ready")
                inst = min(self.ready, key=lambda i: i.in_flight)
                inst.in_flight += 1
                return inst
            finally:
                self.waiting -= 1

    def release(self, inst: Instance) -> None:
        with self._cond:
            inst.in_flight -= 1
            self._cond.notify_all()

    def _start_one(self) -> None:
        with self._cond:
            self._numbers += 1
            number = self._numbers
        try:
            inst = Instance(number, self.redis_url, self.log)
        except RuntimeError as e:
            print(f"lifl sl: {e}", file=sys.stderr)
            with self._cond:
                self.starting -= 1
            return
        with self._cond:
            self.starting -= 1
            self.ready.append(inst)
            self.started_total += 1
            self.cold_starts_s.append(inst.cold_start_s)
            self._cond.notify_all()

    def stop_idle(self, count: int) -> None:
        with self._cond:
            idle = [i for i in self.ready if i.in_flight == 0][:count]
            for inst in idle:
                self.ready.remove(inst)
        for inst in idle:
            inst.stop()

    def counts(self) -> tuple[int, int, int]:
        """(ready, starting, waiting requests)."""
        with self._cond:
            return len(self.ready), self.starting, self.waiting

    def concurrency(self) -> float:
        """In-flight requests as the sidecars report them, plus those waiting for an instance."""
        with self._cond:
            instances, waiting = list(self.ready), self.waiting
        total = float(waiting)
        for inst in instances:
            try:
                total += get_json(inst.address, "/_/stats")["concurrency"]
            except (OSError, ValueError, KeyError):
                total += inst.in_flight
        return total

    def pids(self) -> list[int]:
        with self._cond:
            return [pid for inst in self.ready for pid in inst.pids()]

    def stop_all(self) -> None:
        with self._cond:
            instances, self.ready = self.ready, []
        for inst in instances:
            inst.stop()


@dataclass
class RoundWork:
    goal: int
    fan_in: int
    started: float = field(default_factory=time.time)
    taken: int = 0  # updates read from the broker for leaves
    after: str = "0-0"  # the last update entry read
    top_invoked: bool = False

    @property
    def leaves(self) -> int:
        return math.ceil(self.goal / self.fan_in)


class Dispatcher:
    def __init__(self, redis_url: str, fan_in: int, kpa: KpaConfig, log: Any = sys.stdout) -> None:
        self.jobs = Jobs(redis_url)
        self.broker = Broker(redis_url)
        self.fan_in = fan_in
        self.pool = Pool(redis_url, log)
        self.kpa_config = kpa
        self.kpa = Kpa(kpa)
        self.rounds: dict[tuple[str, int], RoundWork] = {}
        self.invocations = futures.ThreadPoolExecutor(MAX_INVOCATIONS)
        self.stop = threading.Event()
        self._activated = threading.Event()
        self._rounds_lock = threading.Lock()  # the trigger and finished invocations both change rounds

    # the trigger
    def follow(self) -> None:
        after = self.broker.last_event()
        while not self.stop.is_set():
            for event_id, kind, job, version in self.broker.events(after, 500):
                after = event_id
                with self._rounds_lock:
                    self.on_event(kind, job, version)

    def on_event(self, kind: str, job: str, version: int) -> None:
        key = (job, version)
        work = self.rounds.get(key)
        if work is None:
            if kind != UPDATES:
                return
            work = self.rounds[key] = RoundWork(self.jobs.status(job).goal, self.fan_in)
        if kind == UPDATES:
            available = self.broker.length(UPDATES, job, version) - work.taken
            while work.taken < work.goal:
                batch = min(work.fan_in, work.goal - work.taken)
                if available < batch:
                    break
                entries = self.broker.read(UPDATES, job, version, work.after, batch)
                work.after = entries[-1][0]
                work.taken += len(entries)
                available -= len(entries)
                self.submit(job, version, "leaf", [item for _, item in entries], work.started)
        elif not work.top_invoked and self.broker.length(PARTIALS, job, version) >= work.leaves:
            work.top_invoked = True
            partials = [item for _, item in self.broker.read(PARTIALS, job, version, "0-0", work.leaves)]
            self.submit(job, version, "top", partials, work.started)

    def submit(self, job: str, version: int, role: str, items: list[Input], started: float) -> None:
        if len(items) > MAX_BATCH_INPUTS:
            raise ValueError(f"a batch holds at most {MAX_BATCH_INPUTS} inputs")
        self._activated.set()
        self.invocations.submit(self.invoke, job, version, role, items, started)

    def invoke(self, job: str, version: int, role: str, items: list[Input], started: float) -> None:
        path = f"/invoke?{urllib.parse.urlencode({'job': job, 'version': version, 'role': role, 'started': repr(started)})}"
        try:
            inst = self.pool.acquire()
            try:
                reply = post(inst.address, path, frame(items))
            finally:
                self.pool.release(inst)
            if reply.status != 200:
                raise RuntimeError(f"{role} of {job} v{version} failed ({reply.status}): {reply.body[:300]!r}")
            if role == "leaf":
                self.broker.publish(PARTIALS, job, version, next(unframe(reply.body)))
            else:
                self.broker.drop(UPDATES, job, version)
                self.broker.drop(PARTIALS, job, version)
                with self._rounds_lock:
                    self.rounds.pop((job, version), None)
        except Exception as e:  # an invocation failing loses its round, as a function failure does on stock serverless
            print(f"lifl sl: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    # the autoscaler (KPA), with the activator's poke from zero
    def autoscale(self) -> None:
        tick = self.kpa_config.tick_s
        while not self.stop.is_set():
            poked = self._activated.wait(tick)
            self._activated.clear()
            now = time.monotonic()
            self.kpa.record(now, self.pool.concurrency())
            ready, starting, waiting = self.pool.counts()
            desired = self.kpa.decide(now, ready)
            if poked and ready + starting == 0 and waiting:
                desired = max(desired, 1)
            if desired > ready + starting:
                self.pool.start(desired - ready - starting)
            elif desired < ready:
                self.pool.stop_idle(ready - desired)

    def status(self) -> dict[str, Any]:
        ready, starting, waiting = self.pool.counts()
        return {"instances": ready, "starting": starting, "waiting": waiting, "cold_starts": self.pool.started_total,
                "cold_start_s": list(self.pool.cold_starts_s)}


def status_handler(dispatcher: Dispatcher) -> type[httpd.Handler]:
    class StatusHandler(httpd.Handler):
        def do_GET(self) -> None:
            self.guarded(lambda: self.send_json(200, dispatcher.status()) if self.path == "/status"
                         else self.send_error_of(NotFound(f"GET {self.path[:200]} is not served", code="no_route")))

    return StatusHandler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-baseline-serverless")
    p.add_argument("role", choices=("function", "sidecar", "dispatcher"))
    p.add_argument("--redis", help="function, dispatcher: the broker and job store")
    p.add_argument("--target", help="sidecar: its function's address")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--fan-in", type=int, default=DEFAULT_FAN_IN, help="dispatcher: updates per leaf invocation")
    p.add_argument("--kpa-scale", type=float, default=1.0, help="dispatcher: KPA's windows and tick times this")
    args = p.parse_args(argv)
    die_with_parent()
    stop = threading.Event()
    on_signals(stop.set)
    if args.role == "function":
        server = httpd.serve(function_handler(Jobs(args.redis)), args.listen, MAX_BATCH_BYTES)
        print(f"function listening on {server.address}", flush=True)
    elif args.role == "sidecar":
        server = httpd.serve(sidecar_handler(args.target, SidecarStats()), args.listen, MAX_BATCH_BYTES)
        print(f"sidecar listening on {server.address}", flush=True)
    else:
        if not 1 <= args.fan_in <= MAX_BATCH_INPUTS:
            raise SystemExit(f"lifl sl: --fan-in must be in [1, {MAX_BATCH_INPUTS}]")
        dispatcher = Dispatcher(args.redis, args.fan_in, KpaConfig().scaled(args.kpa_scale))
        threading.Thread(target=dispatcher.autoscale, daemon=True).start()
        threading.Thread(target=dispatcher.follow, daemon=True).start()
        server = httpd.serve(status_handler(dispatcher), args.listen, 0)
        print(f"dispatcher listening on {server.address}", flush=True)
        stop.wait()
        dispatcher.stop.set()
        dispatcher.pool.stop_all()
        server.shutdown()
        return
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
