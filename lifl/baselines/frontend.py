"""The client-facing front of the baseline systems: the part of lifl's HTTP API that FL clients
use (``lifl.client.Gateway``: create a job, set and fetch the model, push an update), so the
same client SDK drives every system.

An update's body is read whole into the process's memory, validated as lifl's gateway does
(structure, the job's model, finite floats), given a slot of the round, and handed to the
system's queue (``Sink``):

- SF-mono (``--sink leaf``): this process *is* the always-on leaf aggregator; the update
  waits in its in-memory queue and is folded as soon as the aggregator thread takes it;
- SF-micro and SL (``--sink broker``): the update is appended to the message broker (Redis
  streams) and this process forgets it.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from lifl import kernels
from lifl.baselines import httpd
from lifl.baselines.aggregate import Input
from lifl.baselines.broker import UPDATES, Broker
from lifl.baselines.jobs import Jobs
from lifl.errors import BadRequest, NotFound
from lifl.jobs import NO_VERSION, version_wait_query
from lifl.procs import die_with_parent, on_signals

MAX_UPDATE_BYTES = 1 << 30  # an update (or model) body; the largest model of the comparisons is 230 MB
MAX_JSON_BYTES = 64 << 10
MAX_SAMPLES = 1 << 40
_JOB_PATH = re.compile(r"/v1/jobs/([^/?]+)(/model|/updates|/version)?")


class Sink(Protocol):
    def put(self, job: str, version: int, item: Input) -> None:
        """Hand an accepted update of round ``version`` to the system's queue."""


class BrokerSink:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def put(self, job: str, version: int, item: Input) -> None:
        self.broker.publish(UPDATES, job, version, item)


class QueueSink:
    """SF-mono: the aggregator's own in-memory queue, drained by its aggregation thread."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[str, int, Input]] = queue.SimpleQueue()

    def put(self, job: str, version: int, item: Input) -> None:
        self.queue.put((job, version, item))


def _integer(headers: Any, name: str, low: int, high: int) -> int:
    text = headers.get(name)
    if text is None or not re.fullmatch(r"-?[0-9]{1,19}", text) or not low <= int(text) <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {str(text)[:32]!r}", code="bad_header")
    return int(text)


class Frontend:
    def __init__(self, jobs: Jobs, sink: Sink) -> None:
        self.jobs = jobs
        self.sink = sink
        self._models: dict[str, tuple[int, bytes]] = {}  # the last model served per job, by version
        self._lock = threading.Lock()  # held while a new version is fetched: the others wait for it
        self._versions: dict[str, int] = {}  # the latest version installed per job, as announced
        self._installed = threading.Condition()  # notified with each announcement

    def follow_installs(self, stop: threading.Event) -> None:
        """Keep the versions waits look at up to date from the installs announced, in a thread of
        its own; subscribed before this returns, so that no wait misses an install."""
        installs = self.jobs.installs()
        threading.Thread(target=self._follow, args=(installs, stop), daemon=True).start()

    def _follow(self, installs: Iterator[tuple[str, int] | None], stop: threading.Event) -> None:
        for installed in installs:
            if stop.is_set():
                return
            if installed is not None:
                job, version = installed
                with self._installed:
                    self._versions[job] = max(version, self._versions.get(job, NO_VERSION))
                    self._installed.notify_all()

    def wait_for_version(self, job: str, after: int, wait_s: float) -> dict[str, Any]:
        """The job's status once its version passes ``after``, or after ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        status = self.jobs.status(job)
        if status.version > after or wait_s <= 0:
            return status.to_dict()
        with self._installed:
            self._installed.wait_for(lambda: self._versions.get(job, NO_VERSION) > after, max(0.0, deadline - time.monotonic()))
        return self.jobs.status(job).to_dict()

    def model(self, job: str) -> tuple[int, bytes]:
        """The current model, fetched from the store once per version however many clients ask
        at once (they all ask right after a new version)."""
        current = self.jobs.status(job).version
        with self._lock:
            cached = self._models.get(job)
            if cached is None or cached[0] < current:
                version, blob = self.jobs.model(job)
                cached = self._models[job] = (version, blob)
            return cached

    def push(self, job: str, headers: Any, body: bytearray) -> dict[str, Any]:
        samples = _integer(headers, "X-Lifl-Samples", 1, MAX_SAMPLES)
        base = _integer(headers, "X-Lifl-Base-Version", 0, 1 << 62)
        kernels.validate(body, self.jobs.spec(job), limit=MAX_UPDATE_BYTES)
        _, version = self.jobs.take_slot(job, base)
        self.sink.put(job, version, Input(body, samples, 1, False))
        return {"version": version}


def handler_for(frontend: Frontend) -> type[httpd.Handler]:
    class FrontendHandler(httpd.Handler):
        def route(self) -> tuple[str, str]:
            path = self.path.split("?", 1)[0]
            m = _JOB_PATH.fullmatch(path)
            if path == "/v1/jobs":
                return "jobs", ""
            if m is None:
                raise NotFound(f"no such resource: {path[:200]}", code="no_route")
            return (m.group(2) or "/job")[1:], m.group(1)

        def do_GET(self) -> None:
            def serve() -> None:
                what, job = self.route()
                if what == "job":
                    self.send_json(200, self.jobs_status(job))
                elif what == "version":
                    after, wait_s = version_wait_query(self.path.partition("?")[2])
                    self.send_json(200, frontend.wait_for_version(job, after, wait_s))
                elif what == "model":
                    version, blob = frontend.model(job)
                    self.send_parts(200, [blob], "application/octet-stream", {"X-Lifl-Version": str(version)})
                else:
                    raise NotFound(f"GET {self.path[:200]} is not served", code="no_route")
            self.guarded(serve)

        def jobs_status(self, job: str) -> dict[str, Any]:
            status = frontend.jobs.status(job).to_dict()
            status["rounds"] = frontend.jobs.round_count(job)
            return status

        def do_POST(self) -> None:
            def serve() -> None:
                what, job = self.route()
                if what == "jobs":
                    if self.body_length() > MAX_JSON_BYTES:
                        raise BadRequest(f"a job description is at most {MAX_JSON_BYTES} bytes", code="too_large")
                    try:
                        spec = json.loads(self.read_body())
                    except ValueError as e:
                        raise BadRequest(f"the body is not JSON: {e}", code="bad_json") from None
                    if not isinstance(spec, dict):
                        raise BadRequest("a job description is a JSON object", code="bad_json")
                    self.send_json(201, frontend.jobs.create(spec.get("job"), spec.get("goal")).to_dict())
                elif what == "updates":
                    self.send_json(200, frontend.push(job, self.headers, self.read_body()))
                else:
                    raise NotFound(f"POST {self.path[:200]} is not served", code="no_route")
            self.guarded(serve)

        def do_PUT(self) -> None:
            def serve() -> None:
                what, job = self.route()
                if what != "model":
                    raise NotFound(f"PUT {self.path[:200]} is not served", code="no_route")
                self.send_json(200, {"version": frontend.jobs.set_model(job, self.read_body())})
            self.guarded(serve)

    return FrontendHandler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-baseline-frontend")
    p.add_argument("--http", default="127.0.0.1:0")
    p.add_argument("--redis", required=True)
    p.add_argument("--sink", choices=("leaf", "broker"), required=True)
    p.add_argument("--top", help="with --sink leaf: the top aggregator's gRPC address")
    args = p.parse_args(argv)
    die_with_parent()
    jobs = Jobs(args.redis)
    stop = threading.Event()
    on_signals(stop.set)
    if args.sink == "leaf":
        from lifl.baselines.serverful import Leaf, TopClient

        sink = QueueSink()
        leaf = Leaf(jobs, TopClient(args.top))
        threading.Thread(target=leaf.drain, args=(sink.queue, stop), daemon=True).start()
        frontend = Frontend(jobs, sink)
    else:
        frontend = Frontend(jobs, BrokerSink(Broker(args.redis)))
    frontend.follow_installs(stop)
    server = httpd.serve(handler_for(frontend), args.http, MAX_UPDATE_BYTES)
    print(f"frontend listening on {server.address}", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main()
