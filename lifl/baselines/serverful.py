"""SF, the serverful baselines (Bonawitz et al. 2019; Papaya, Huba et al. 2022): always-on
aggregators with a direct gRPC channel from leaf to top.

- The leaf (``Leaf``) folds every update as soon as it takes it (eager, like lifl) and, once it
  has the round's goal, streams its partial sum to the top over one persistent gRPC channel.
  In SF-mono it runs inside the frontend, which queues updates in its memory; in SF-micro it
  is a stateless process of its own that reads updates from the broker (``main leaf``).
- The top (``main top``) is a gRPC server: it receives partial sums into preallocated buffers,
  acknowledges each once it is whole, folds them in its aggregation thread and installs the
  average as the next version.

gRPC carries bytes in messages of ``CHUNK`` bytes (its default limit is 4 MiB per message);
the first message of a stream is the JSON description of the partial that follows.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from lifl.baselines.aggregate import Aggregation, Input
from lifl.baselines.broker import UPDATES, Broker
from lifl.baselines.jobs import Jobs
from lifl.errors import LiflError
from lifl.procs import die_with_parent, on_signals

CHUNK = (4 << 20) - 1024  # under gRPC's default 4 MiB message limit, with room for framing
MAX_MESSAGE = 8 << 20
MAX_PARTIAL_BYTES = 4 << 30  # a partial in float64 of a 230 MB float32 model is 460 MB
PARTIAL_METHOD = "/lifl.baseline.Top/Partial"
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
BROKER_POLL_MS = 1000
MAX_FAN_IN = 1024


class TopClient:
    """The leaf's end of its direct channel to the top."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._call = self.channel.stream_unary(PARTIAL_METHOD)

    def send(self, job: str, version: int, item: Input, fan_in: int, timeout: float = 300.0) -> dict[str, Any]:
        """Stream one partial (or lone update) to the top; returns its acknowledgement."""
        meta = {"job": job, "version": version, "fan_in": fan_in, "samples": item.samples, "updates": item.updates,
                "partial": item.partial, "size": len(item.blob)}

        def messages() -> Iterator[bytes]:
            yield json.dumps(meta).encode()
            view = memoryview(item.blob)
            for start in range(0, len(view), CHUNK):
                yield bytes(view[start : start + CHUNK])

        return json.loads(self._call(messages(), timeout=timeout))

    def close(self) -> None:
        self.channel.close()


class Leaf:
    """An always-on leaf aggregator: one running fold per round, the partial sent at the goal."""

    def __init__(self, jobs: Jobs, top: TopClient) -> None:
        self.jobs = jobs
        self.top = top
        self._rounds: dict[tuple[str, int], Aggregation] = {}

    def take(self, job: str, version: int, item: Input) -> None:
        agg = self._rounds.get((job, version))
        if agg is None:
            agg = self._rounds[(job, version)] = Aggregation(self.jobs.spec(job), self.jobs.status(job).goal)
        self.jobs.mark_taken(job, 1)
        agg.offer([item])
        if agg.complete:
            del self._rounds[(job, version)]
            try:
                self.top.send(job, version, agg.result(), fan_in=1)
            finally:
                agg.close()

    def drain(self, updates: queue.SimpleQueue[tuple[str, int, Input]], stop: threading.Event) -> None:
        """SF-mono: take updates from the in-memory queue until stopped."""
        while not stop.is_set():
            try:
                job, version, item = updates.get(timeout=0.5)
            except queue.Empty:
                continue
            self.take(job, version, item)

    def consume(self, broker: Broker, stop: threading.Event) -> None:
        """SF-micro: take updates from the broker as they are announced."""
        after = broker.last_event()
        read: dict[tuple[str, int], str] = {}  # the last entry taken of each round's stream
        while not stop.is_set():
            for event_id, kind, job, version in broker.events(after, BROKER_POLL_MS):
                after = event_id
                if kind != UPDATES:
                    continue
                for entry_id, item in broker.read(UPDATES, job, version, read.get((job, version), "0-0"), 1 << 20):
                    read[(job, version)] = entry_id
                    self.take(job, version, item)
                if (job, version) not in self._rounds:  # the round is complete: its stream goes
                    broker.drop(UPDATES, job, version)
                    read.pop((job, version), None)


class Top:
    """The top aggregator: partials in, the averaged model installed."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self._inbox: queue.SimpleQueue[tuple[dict[str, Any], Input]] = queue.SimpleQueue()
        self._rounds: dict[tuple[str, int], tuple[Aggregation, float]] = {}

    def partial(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            meta = json.loads(next(messages))
            size, fan_in = int(meta["size"]), int(meta["fan_in"])
            self.jobs.spec(str(meta["job"]))
        except (ValueError, KeyError, TypeError, StopIteration) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a partial starts with its JSON description: {e}")
        except LiflError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, e.message)
        if not 0 < size <= MAX_PARTIAL_BYTES or not 1 <= fan_in <= MAX_FAN_IN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a partial has 1 to {MAX_PARTIAL_BYTES} bytes (not {size}) and a fan-in of 1 to {MAX_FAN_IN} (not {fan_in})")
        buffer = bytearray(size)
        got = 0
        for chunk in messages:
            if got + len(chunk) > size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than the {size} bytes announced")
            buffer[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got != size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{got} of the {size} bytes announced arrived")
        received_at = time.time()
        self._inbox.put((meta, Input(buffer, int(meta["samples"]), int(meta["updates"]), bool(meta["partial"]))))
        return json.dumps({"received_at": received_at}).encode()

    def aggregate(self, stop: threading.Event) -> None:
        """The aggregation thread: fold partials as they come, install each round's average."""
        while not stop.is_set():
            try:
                meta, item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            key = (str(meta["job"]), int(meta["version"]))
            try:
                self._fold(key, int(meta["fan_in"]), item)
            except Exception as e:  # a bad partial loses its round, not the top
                print(f"lifl sf top: round {key}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                dropped = self._rounds.pop(key, None)
                if dropped:
                    dropped[0].close()

    def _fold(self, key: tuple[str, int], fan_in: int, item: Input) -> None:
        if key not in self._rounds:
            self._rounds[key] = (Aggregation(self.jobs.spec(key[0]), fan_in), time.time())
        agg, started = self._rounds[key]
        agg.offer([item])
        if agg.complete:
            del self._rounds[key]
            try:
                model, total = agg.model()
                self.jobs.install(key[0], key[1], model, total.samples, total.updates, started)
            finally:
                agg.close()


def serve_top(jobs: Jobs, address: str = "127.0.0.1:0") -> tuple[grpc.Server, int, threading.Event]:
    top = Top(jobs)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "lifl.baseline.Top", {"Partial": grpc.stream_unary_rpc_method_handler(top.partial)}),))
    port = server.add_insecure_port(address)
    server.start()
    stop = threading.Event()
    threading.Thread(target=top.aggregate, args=(stop,), daemon=True).start()
    return server, port, stop


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-baseline-serverful")
    p.add_argument("role", choices=("top", "leaf"))
    p.add_argument("--redis", required=True)
    p.add_argument("--listen", default="127.0.0.1:0", help="top: the gRPC address")
    p.add_argument("--top", help="leaf: the top's gRPC address")
    args = p.parse_args(argv)
    die_with_parent()
    stop = threading.Event()
    on_signals(stop.set)
    jobs = Jobs(args.redis)
    if args.role == "top":
        server, port, aggregating = serve_top(jobs, args.listen)
        print(f"top listening on {args.listen.rsplit(':', 1)[0]}:{port}", flush=True)
        stop.wait()
        aggregating.set()
        server.stop(grace=1.0).wait()
        return
    leaf = Leaf(jobs, TopClient(args.top))
    print("leaf consuming", flush=True)
    leaf.consume(Broker(args.redis), stop)
    leaf.top.close()


if __name__ == "__main__":
    main()
