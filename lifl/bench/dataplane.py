"""`lifl bench dataplane`: the node's data plane against physical references from the same run.

For float32 updates of ResNet-18/34/152 sizes (44.7, 83.3, 230 MB), on a real node:

- ingest_http_ms / ingest_grpc_ms: from the client's first byte until the gateway has
  acknowledged the update in shared memory (grpcio client, 1 MiB chunks);
- raw_tcp_ms: the same bytes through a plain loopback socket into a pre-faulted shared-memory
  buffer of a separate process, acknowledged with one byte: the fastest plain-socket transfer
  found on this machine with lifl's socket options, sent the way lifl's client sends (a socket
  with a timeout: sendall() waits in poll()). Ingest ratios are taken against it;
  lifl.bench.rawsink says what it does and why. raw_tcp_naive_ms: the same, its sender blocking
  in one send() of the whole update, as the reference before it (which lifl's HTTP ingest beat:
  0.72-0.94x); 1.1-1.5x raw_tcp_ms at 230 MB, 0.9-1.3x at 83 MB (ratios: raw_tcp_naive);
- handoff_us: leaf -> middle delivery of a key until the middle holds a readable view, as the
  middle aggregator measured it (handoff_delivery_us: until the key was in its hands;
  handoff_premapped: the share of hand-offs whose object the middle had mapped already, the
  leaf having announced it when its last fold began);
  wake_us, its reference: one-way latency of a 64-byte message to a process that sat idle for
  20 ms in select() (AF_UNIX, what waking an idle CPU costs on this machine);
- aggregate_ms: the weighted accumulate of one update, as leaves fold them (two updates in
  one fused pass into a float64 accumulator; half that pass per update);
  accumulate_single_ms: one update folded alone into a warm float64 accumulator;
- memcpy_ms: a copy of the same size between two pre-faulted shared-memory buffers;
- fixed_point: the deterministic integer path (lifl.fixedpoint) beside the float one, in this
  process on the same buffers: fold_ms per update when two updates fold in one pass into a
  fresh accumulator (float64; int64 at frac_bits 24, int32 at frac_bits 16), the ratio to the
  float fold, and the max/mean |error| of the fixed-point average against float64 FedAvg;
- peak_rss_mb: proportional set size (shared pages counted once) of the gateway and the
  aggregators while one 230 MB update is received and handed to its leaf;
- tls: what user-space TLS costs (this kernel may have no kernel TLS): the same uploads to a
  second node serving TLS (ingest_https_ms, ingest_grpcs_ms; TLS 1.3, AES-GCM as negotiated)
  and the raw-socket reference over TLS (raw_tls_ms), each beside its plain twin, as throughput
  (GB/s) and CPU seconds per GB on the client (this process) and the server (the gateway, or
  the raw sink): ``cpu_s_per_gb`` for every path, ``tls`` for the pairs.

Each figure is the median of --reps repetitions, interleaved (raw, HTTP, gRPC, ...) on a quiet
node so that background work and drift hit all of them alike; CPU per GB is the sum over the
repetitions (the server's is counted in clock ticks, 10 ms).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc

from lifl import format as fmt
from lifl.bench.channel import PLACEMENTS, WOKEN_IDLE_S, channel_latency
from lifl.client import Gateway
from lifl.fixedpoint import FixedPoint, partial_spec
from lifl.kernels import Tensors, finalize, fold
from lifl.net.tls import ALPN_HTTP, ClientTls, ServerTls
from lifl.node.supervisor import Node, NodeConfig
from lifl.procstat import cpu_seconds, pss_mb
from lifl.protocol import GetRecent, Hello
from lifl.rpc import Client

MODELS = [("resnet18", 44.7e6, 122), ("resnet34", 83.3e6, 218), ("resnet152", 230e6, 932)]  # name, bytes, tensors
TARGETS = {
    "ingest_http": ("ingest_http_ms", "raw_tcp_ms", 1.5),
    "ingest_grpc": ("ingest_grpc_ms", "raw_tcp_ms", 2.0),
    "aggregate": ("aggregate_ms", "memcpy_ms", 1.5),
}
HANDOFF_TARGET_US = 250.0  # p50, leaf -> a readable view in its parent
MEMORY_TARGET = 1.3
WAKE_MESSAGES = 100
TLS_PAIRS = {"raw": ("raw_tcp_ms", "raw_tls_ms"), "http": ("ingest_http_ms", "ingest_https_ms"),
             "grpc": ("ingest_grpc_ms", "ingest_grpcs_ms")}  # path -> (plain, TLS) measurements


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--reps", type=int, default=7, help="repetitions per measurement (default 7)")
    p.add_argument("--models", default=",".join(m[0] for m in MODELS), help="comma-separated subset of " + ", ".join(m[0] for m in MODELS))
    p.add_argument("--no-tls", dest="tls", action="store_false", help="skip the cost of TLS (a second node, serving TLS)")


def main(args: argparse.Namespace) -> int:
    wanted = args.models.split(",")
    unknown = set(wanted) - {m[0] for m in MODELS}
    if unknown:
        print(f"lifl bench: unknown model(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    result = run([m for m in MODELS if m[0] in wanted], args.reps, log=not args.json, tls=args.tls)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def synthetic_shapes(total_bytes: float, n_tensors: int, rng: np.random.Generator) -> list[tuple[str, tuple[int, ...]]]:
    """A ResNet-like state dict: a quarter large weight tensors, the rest small vectors."""
    n_large = max(1, n_tensors // 4)
    small = [int(rng.integers(64, 2048)) for _ in range(n_tensors - n_large)]
    remaining = int(total_bytes) // 4 - sum(small)
    weights = rng.random(n_large) + 0.1
    large = [int(w) for w in weights / weights.sum() * remaining]
    large[-1] += remaining - sum(large)
    shapes = [(f"layer{i}.weight", (n // 9, 9) if n % 9 == 0 else (n,)) for i, n in enumerate(large)]
    shapes += [(f"layer{i}.bn", (n,)) for i, n in enumerate(small)]
    return shapes


def self_signed(directory: Path) -> tuple[Path, Path] | None:
    """A certificate (and key) for 127.0.0.1, for the bench's TLS node; None without the
    cryptography package (a development dependency)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    import datetime
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lifl bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "bench-cert.pem", directory / "bench-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def make_blob(shapes: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> bytes:
    return fmt.encode({name: (rng.standard_normal(shape, dtype=np.float32) * 0.05) for name, shape in shapes})


class ShmBuffer:
    """A pre-faulted shared-memory buffer of the bench's own (for the memcpy reference)."""

    def __init__(self, size: int) -> None:
        self._shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, size=size)
        self.mm = mmap.mmap(self._shm.fd, size)
        self._shm.close_fd()
        self._shm.unlink()
        self.array = np.frombuffer(self.mm, np.uint8)
        self.array[::4096] = 1

    def close(self) -> None:
        del self.array
        self.mm.close()


def task_reports(run_dir: Path, job: str) -> list[dict[str, Any]]:
    """The statistics of a node's finished tasks of ``job`` (each with its ``role``), as its agent
    keeps them (``GetRecent``)."""
    agent = Client.connect(str(run_dir / "agent.sock"), Hello("gateway"))
    try:
        return [{**t.stats, "role": t.role} for t in agent.call(GetRecent())[0].tasks if t.job == job]
    finally:
        agent.close()


class Bench:
    def __init__(self, reps: int, log: bool, tls: bool = True) -> None:
        self.reps = reps
        self.log = log
        self.tmp = Path(tempfile.mkdtemp(prefix="lifl-bench-", dir="/tmp"))
        os.chmod(self.tmp, 0o755)
        self.node = self.start_node("b", None)
        self.addresses = self.node.start()
        self.http = Gateway(self.addresses.http, token=self.node.operator_token)
        self.grpc = Gateway(self.addresses.grpc, protocol="grpc", token=self.node.operator_token)
        import grpc

        from lifl.net import lifl_pb2, lifl_pb2_grpc

        self._pb = lifl_pb2
        self._channel = grpc.insecure_channel(self.addresses.grpc)
        self._metadata = [("authorization", f"Bearer {self.node.operator_token}")]
        self.stub = lifl_pb2_grpc.GatewayStub(self._channel)
        self.warm_instances(self.http)
        # the cost of TLS: a second node serving TLS, for the same uploads
        self.tls_files = self_signed(self.tmp) if tls else None
        self.tls_node: Node | None = None
        if self.tls_files is not None:
            self.tls_node = self.start_node("s", ServerTls(*map(str, self.tls_files)))
            secure, ca = self.tls_node.start(), ClientTls(ca=self.tls_files[0])
            self.https = Gateway(secure.http, tls=ca, token=self.tls_node.operator_token)
            self.grpcs = Gateway(secure.grpc, protocol="grpc", tls=ca, token=self.tls_node.operator_token)
            self.warm_instances(self.https)

    def start_node(self, stem: str, tls: ServerTls | None) -> Node:
        name = f"{stem}{os.getpid() % 100000}"
        return Node(NodeConfig(
            node=name, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=self.tmp / name / "run",
            data_dir=self.tmp / name / "data", shm_capacity=8 << 30, pool_limit=4 << 30, keep_warm=600, tls=tls,
        ), log=sys.stderr)  # stdout carries the result alone

    def warm_instances(self, gw: Gateway) -> None:
        """Run one tiny round so the tenant's aggregator processes exist before anything is
        measured: instances are per tenant and reused by every job, so their memory and their
        start-up are per-instance costs, not per-update ones (reported under memory)."""
        blob = fmt.encode({"w": np.ones(16, np.float32)})
        gw.create_job("warmup", 4)
        gw.set_model("warmup", blob)
        for i in range(4):
            gw.push("warmup", blob, client=f"w{i}", samples=10, base_version=0)
        self.wait_for_version("warmup", 1, gw)

    def close(self) -> None:
        self.http.close()
        self.grpc.close()
        self._channel.close()
        self.node.stop()
        if self.tls_node is not None:
            self.https.close()
            self.grpcs.close()
            self.tls_node.stop()
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    def say(self, text: str) -> None:
        if self.log:
            print(text, file=sys.stderr, flush=True)

    # -- clients ------------------------------------------------------------------------------
    def ingest_http(self, job: str, blob: bytes, client: str) -> float:
        return self.ingest(self.http, job, blob, client)

    def ingest_grpc(self, job: str, blob: bytes, client: str) -> float:
        return self.ingest(self.grpc, job, blob, client)

    @staticmethod
    def ingest(gw: Gateway, job: str, blob: bytes, client: str) -> float:
        t0 = time.perf_counter()
        gw.push(job, blob, client=client, samples=10, base_version=0)
        return (time.perf_counter() - t0) * 1e3

    def ingest_grpcio(self, job: str, blob: bytes, client: str) -> float:
        pb, view = self._pb, memoryview(blob)

        def chunks():
            yield pb.UpdateChunk(meta=pb.UpdateMeta(job=job, client=client, samples=10, base_version=0, size=len(blob)))
            for i in range(0, len(blob), 1 << 20):
                yield pb.UpdateChunk(data=bytes(view[i : i + (1 << 20)]))

        t0 = time.perf_counter()
        self.stub.PushUpdate(chunks(), metadata=self._metadata)
        return (time.perf_counter() - t0) * 1e3

    def wait_quiet(self, timeout: float = 30.0) -> None:
        """Until the node's processes have used no CPU for 100 ms (aggregation done)."""
        deadline = time.monotonic() + timeout
        last = -1.0
        nodes = [self.node] + ([self.tls_node] if self.tls_node is not None else [])
        while time.monotonic() < deadline:
            pids = [p for node in nodes for group in node.pids().values() for p in group]
            now = cpu_seconds(pids)
            if now - last < 0.005:
                return
            last = now
            time.sleep(0.1)

    # -- one model size ---------------------------------------------------------------------------
    def measure(self, name: str, size: float, n_tensors: int) -> dict[str, Any]:
        rng = np.random.default_rng(len(name))
        shapes = synthetic_shapes(size, n_tensors, rng)
        model, update = make_blob(shapes, rng), make_blob(shapes, rng)
        nbytes = len(update)
        self.http.create_job(name, 2 + 3 * self.reps)
        self.http.set_model(name, model)
        if self.tls_node is not None:
            self.https.create_job(name, 2 * self.reps)
            self.https.set_model(name, model)
        self.say(f"{name}: {nbytes / 1e6:.1f} MB, {len(shapes)} tensors")

        sinks: list[subprocess.Popen] = []
        raw, sink = self.raw_sink(update, sinks, tls=False)
        naive, naive_sink = self.raw_sink(update, sinks, tls=False, blocking=True)
        gateway = self.node.pids()["gateway"]
        paths: dict[str, tuple[Callable[[int], float], list[int]]] = {  # measurement -> (one try, server processes)
            "raw_tcp_ms": (lambda r: self.raw_send(raw, update), [sink]),
            "raw_tcp_naive_ms": (lambda r: self.raw_send(naive, update), [naive_sink]),
            "ingest_http_ms": (lambda r: self.ingest_http(name, update, f"h{r}"), gateway),
            "ingest_grpc_ms": (lambda r: self.ingest_grpc(name, update, f"g{r}"), gateway),
            "ingest_grpcio_ms": (lambda r: self.ingest_grpcio(name, update, f"i{r}"), gateway),
        }
        if self.tls_node is not None:
            raw_tls, tls_sink = self.raw_sink(update, sinks, tls=True)
            secure_gateway = self.tls_node.pids()["gateway"]
            paths["raw_tls_ms"] = (lambda r: self.raw_send(raw_tls, update), [tls_sink])
            paths["ingest_https_ms"] = (lambda r: self.ingest(self.https, name, update, f"hs{r}"), secure_gateway)
            paths["ingest_grpcs_ms"] = (lambda r: self.ingest(self.grpcs, name, update, f"gs{r}"), secure_gateway)

        out: dict[str, Any] = {"size_mb": round(nbytes / 1e6, 1), "tensors": len(shapes)}
        try:
            self.wait_quiet()
            memory = self.cold_ingest_memory(name, update, nbytes)
            out["ingest_http_cold_ms"] = memory.pop("ingest_ms")
            out["memory"] = memory
            self.wait_quiet()
            out["ingest_grpc_cold_ms"] = round(self.ingest_grpc(name, update, "cold-grpc"), 2)
            samples: dict[str, list[float]] = {key: [] for key in paths}
            cpu: dict[str, list[float]] = {key: [0.0, 0.0] for key in paths}  # client, server seconds over all tries
            for r in range(self.reps):
                for key, (attempt, server) in paths.items():
                    self.wait_quiet()
                    client_cpu, server_cpu = time.process_time(), cpu_seconds(server)
                    samples[key].append(attempt(r))
                    cpu[key][0] += time.process_time() - client_cpu
                    cpu[key][1] += cpu_seconds(server) - server_cpu
            gigabytes = self.reps * nbytes / 1e9
            out["cpu_s_per_gb"] = {key.removesuffix("_ms"): {"client": round(c / gigabytes, 3), "server": round(s / gigabytes, 3)}
                                   for key, (c, s) in cpu.items()}
            for key, values in samples.items():
                out[key] = round(statistics.median(values), 2)
                out[key.replace("_ms", "_min_ms")] = round(min(values), 2)
        finally:
            raw.close()
            naive.close()
            for process in sinks:
                process.kill()
                process.wait()
        self.wait_for_version(name, 1)
        if self.tls_node is not None:
            out["tls"] = tls_cost(out, nbytes)
            self.wait_for_version(name, 1, self.https)
        out.update(self.aggregator_figures(name))
        out.update(self.kernel_figures(update, nbytes))
        out["fixed_point"] = fixed_point_figures(model, update, self.reps)
        return out

    def raw_sink(self, update: bytes, sinks: list[subprocess.Popen], *, tls: bool,
                 blocking: bool = False) -> tuple[socket.socket, int]:
        """A connection to a new raw sink (over TLS: the bench's certificate), and the sink's pid.

        The connection has lifl's socket options (TCP_NODELAY on both ends, kernel-default
        buffer sizes: neither the client nor the gateway sets SO_SNDBUF/SO_RCVBUF) and, unless
        ``blocking`` (the naive reference), the client's send mode: a socket timeout, as
        lifl.client's http.client connection has, so sendall() writes what fits and waits in
        poll() rather than blocking in one send() of the whole update (see lifl.bench.rawsink).
        One update goes through before anything is timed, as lifl's HTTP connection carried the
        model of the same size first: TCP's receive-buffer autotuning starts small."""
        files = list(map(str, self.tls_files)) if tls and self.tls_files else []
        sink = subprocess.Popen([sys.executable, "-m", "lifl.bench.rawsink", str(len(update)), *files], stdout=subprocess.PIPE, text=True)
        sinks.append(sink)
        assert sink.stdout is not None
        raw = socket.create_connection(("127.0.0.1", int(sink.stdout.readline())))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.settimeout(None if blocking else self.http.timeout)
        if tls and self.tls_files:
            raw = ClientTls(ca=self.tls_files[0]).context(ALPN_HTTP).wrap_socket(raw, server_hostname="127.0.0.1")
        self.raw_send(raw, update)
        return raw, sink.pid

    @staticmethod
    def raw_send(raw: socket.socket, update: bytes) -> float:
        t0 = time.perf_counter()
        raw.sendall(update)
        if raw.recv(1) != b"k":
            raise ConnectionError("the raw sink did not acknowledge the update")
        return (time.perf_counter() - t0) * 1e3

    def cold_ingest_memory(self, job: str, update: bytes, nbytes: int) -> dict[str, Any]:
        """The first update of this size (no recycled buffer yet): peak memory while in flight."""
        groups = self.node.pids()
        watched = groups["gateway"] + groups["aggregators"]
        baseline = pss_mb(watched) + pss_mb(groups["agent"])
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                g = self.node.pids()
                peak.append(pss_mb(g["gateway"] + g["aggregators"]) + pss_mb(g["agent"]))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t = self.ingest_http(job, update, "cold-http")
        self.wait_quiet()
        done.set()
        sampler.join()
        g = self.node.pids()
        return {
            "ingest_ms": round(t, 2),
            "baseline_mb": round(baseline, 1),
            "peak_mb": round(max(peak), 1),
            "per_update_ratio": round((max(peak) - baseline) / (nbytes / 2**20), 3),
            "gateway_mb": round(pss_mb(g["gateway"]), 1),
            "aggregators_mb": round(pss_mb(g["aggregators"]), 1),
            "agent_mb": round(pss_mb(g["agent"]), 1),
        }

    def wait_for_version(self, job: str, version: int, gw: Gateway | None = None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (gw or self.http).job(job)["version"] == version:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{job} did not reach version {version}")

    def aggregator_figures(self, job: str) -> dict[str, Any]:
        tasks = task_reports(self.node.run_dir, job)
        pairs = [t for t in tasks if t["role"] == "leaf" and t["inputs"] == 2]
        folds = [(t["agg_s"] - t["alloc_s"]) * 1e3 / 2 for t in pairs]
        handoffs = [us for t in tasks if t["role"] == "middle" for us in t["handoff_us"]]
        deliveries = [us for t in tasks if t["role"] == "middle" for us in t["delivery_us"]]
        premapped = sum(t.get("premapped", 0) for t in tasks if t["role"] == "middle")
        forwards = [t["send_s"] * 1e6 for t in tasks if t["role"] == "leaf"]  # the hand-off's sending side
        return {
            "handoff_forward_us": round(statistics.median(forwards), 1),
            "aggregate_ms": round(statistics.median(folds), 2),
            "aggregate_min_ms": round(min(folds), 2),
            "handoff_us": round(statistics.median(handoffs), 1),
            "handoff_delivery_us": round(statistics.median(deliveries), 1),
            "handoff_max_us": round(max(handoffs), 1),
            "handoff_premapped": round(premapped / len(handoffs), 2),
        }

    def kernel_figures(self, update: bytes, nbytes: int) -> dict[str, Any]:
        """memcpy reference, and a single-update accumulate, on shared-memory buffers in this process."""
        src, dst = ShmBuffer(nbytes), ShmBuffer(nbytes)
        src.array[:] = np.frombuffer(update, np.uint8)
        layout = fmt.parse_layout(update)
        spec = layout.spec()
        partial = fmt.spec_header(spec.partial())
        acc_buf = ShmBuffer(len(partial) + spec.partial().data_bytes)
        acc_buf.array[: len(partial)] = np.frombuffer(partial, np.uint8)
        acc_layout = fmt.parse_layout(acc_buf.mm, allow_partial=True)
        w, acc = Tensors.of(src.mm, layout, spec), Tensors.of(acc_buf.mm, acc_layout, spec)
        fold(acc, [(w, 3)], init=True)
        copies, single = [], []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            np.copyto(dst.array, src.array)
            copies.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            fold(acc, [(w, 3)], init=False)
            single.append((time.perf_counter() - t0) * 1e3)
        w.release()
        acc.release()
        for b in (src, dst, acc_buf):
            b.close()
        return {"memcpy_ms": round(statistics.median(copies), 2), "accumulate_single_ms": round(statistics.median(single), 2)}


FIXED_POINTS = (FixedPoint(24, 64), FixedPoint(16, 32))


def fixed_point_figures(first: bytes, second: bytes, reps: int, weights: tuple[int, int] = (3, 5)) -> dict[str, Any]:
    """Two updates folded in one pass into a fresh accumulator, by the float path and by fixed
    point (median ms per update over ``reps``), and the fixed-point average's error against the
    float64 FedAvg of the same two (averages written as float64, so only quantisation shows)."""
    layout = fmt.parse_layout(first)
    spec = layout.spec()
    inputs = [(Tensors.of(blob, fmt.parse_layout(blob), spec), w) for blob, w in zip((first, second), weights)]
    as_f64 = fmt.ModelSpec(tuple(fmt.TensorSpec(t.name, fmt.F64 if t.dtype.kind == "f" else t.dtype, t.shape) for t in spec.tensors))

    def run(fp: FixedPoint | None) -> tuple[float, np.ndarray]:
        partial = partial_spec(spec, fp)
        header = fmt.spec_header(partial)
        acc_buf = ShmBuffer(len(header) + partial.data_bytes)
        acc_buf.array[: len(header)] = np.frombuffer(header, np.uint8)
        acc = Tensors.of(acc_buf.mm, fmt.parse_layout(acc_buf.mm, allow_partial=True), spec)
        frac_bits = fp.frac_bits if fp else 0
        times = []
        for _ in range(reps + 1):  # the first try faults the accumulator in
            t0 = time.perf_counter()
            fold(acc, inputs, init=True, frac_bits=frac_bits)
            times.append((time.perf_counter() - t0) * 1e3 / len(inputs))
        out = bytearray(fmt.spec_header(as_f64)) + bytearray(as_f64.data_bytes)
        mean = Tensors.of(out, fmt.parse_layout(out), as_f64)
        finalize(mean, acc, sum(weights), frac_bits=frac_bits)
        values = fmt.views(out, fmt.parse_layout(out))
        floats = np.concatenate([values[t.name].reshape(-1) for t in spec.tensors if t.dtype.kind == "f"])
        mean.release()
        acc.release()
        acc_buf.close()
        return statistics.median(times[1:]), floats

    float_ms, reference = run(None)
    figures: dict[str, Any] = {"float_fold_ms": round(float_ms, 4)}  # 0.1 µs: small tests fold in microseconds
    for fp in FIXED_POINTS:
        ms, values = run(fp)
        error = np.abs(values - reference)
        figures[f"f{fp.frac_bits}_w{fp.width}"] = {
            "fold_ms": round(ms, 4), "vs_float": round(ms / float_ms, 2),
            "max_abs_error": float(error.max()), "mean_abs_error": float(error.mean()),
            "error_bound": 2.0 ** -(fp.frac_bits + 1),
        }
    for tensors, _ in inputs:
        tensors.release()
    return figures


def tls_cost(figures: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Each path plain and over TLS: GB/s (of the medians), CPU s/GB, and TLS's time over plain's."""
    out: dict[str, Any] = {}
    for path, pair in TLS_PAIRS.items():
        out[path] = {"time_ratio": round(figures[pair[1]] / figures[pair[0]], 3)}
        for mode, key in zip(("plain", "tls"), pair):
            out[path][mode] = {"gb_s": round(nbytes / 1e6 / figures[key], 3), "cpu_s_per_gb": figures["cpu_s_per_gb"][key.removesuffix("_ms")]}
    return out


def run(models: list[tuple[str, float, int]], reps: int, log: bool = False, tls: bool = True) -> dict[str, Any]:
    bench = Bench(reps, log, tls)
    try:
        sizes = {name: bench.measure(name, size, n) for name, size, n in models}
    finally:
        bench.close()
    wake = channel_latency("unix", WAKE_MESSAGES, PLACEMENTS["cross-cpu"], idle_s=WOKEN_IDLE_S)
    for figures in sizes.values():
        ratios = {name: round(figures[a] / figures[b], 3) for name, (a, b, _) in TARGETS.items()}
        ratios["ingest_grpcio"] = round(figures["ingest_grpcio_ms"] / figures["raw_tcp_ms"], 3)  # informational
        ratios["raw_tcp_naive"] = round(figures["raw_tcp_naive_ms"] / figures["raw_tcp_ms"], 3)  # the old reference, informational
        if "tls" in figures:  # informational: user-space TLS against the plain raw socket, and against raw TLS
            for key in ("raw_tls", "ingest_https", "ingest_grpcs"):
                ratios[key] = round(figures[f"{key}_ms"] / figures["raw_tcp_ms"], 3)
            ratios["ingest_https_vs_raw_tls"] = round(figures["ingest_https_ms"] / figures["raw_tls_ms"], 3)
        figures["ratios"] = ratios
        figures["targets_met"] = {
            **{name: ratios[name] <= limit for name, (_, _, limit) in TARGETS.items()},
            "handoff": figures["handoff_us"] <= HANDOFF_TARGET_US,
            "memory": figures["memory"]["per_update_ratio"] <= MEMORY_TARGET,
        }
    biggest = sizes[max(sizes, key=lambda k: sizes[k]["size_mb"])]
    return {
        "benchmark": "dataplane",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "reps": reps,
        "sizes": sizes,
        "peak_rss_mb": biggest["memory"]["peak_mb"],
        "wake_us": round(wake.p50_us, 1),
        "all_targets_met": all(all(f["targets_met"].values()) for f in sizes.values()),
    }


def print_table(result: dict[str, Any]) -> None:
    cols = ["size_mb", "raw_tcp_ms", "raw_tcp_naive_ms", "ingest_http_ms", "ingest_grpc_ms", "ingest_grpcio_ms", "memcpy_ms", "aggregate_ms", "accumulate_single_ms", "handoff_us"]
    print(f"{'model':<10}" + "".join(f"{c:>22}" for c in cols))
    for name, f in result["sizes"].items():
        print(f"{name:<10}" + "".join(f"{f[c]:>22}" for c in cols))
    print()
    for name, f in result["sizes"].items():
        print(f"{name}: ratios {f['ratios']}, memory per in-flight update {f['memory']['per_update_ratio']}x, targets {f['targets_met']}")
    print(f"peak PSS (gateway + aggregators + agent) with one update of the largest size in flight: {result['peak_rss_mb']} MB")
    for name, f in result["sizes"].items():
        fixed = f.get("fixed_point")
        if fixed:
            paths = ", ".join(f"{k}: {v['fold_ms']} ms ({v['vs_float']}x), max|err| {v['max_abs_error']:.3g} "
                              f"mean {v['mean_abs_error']:.3g} (bound {v['error_bound']:.3g})" for k, v in fixed.items() if k != "float_fold_ms")
            print(f"{name}: fold per update, float {fixed['float_fold_ms']} ms; fixed point {paths}")
    if any("tls" in f for f in result["sizes"].values()):
        print("\nthe cost of TLS (user space; GB/s of the median try; CPU s/GB client + server):")
        print(f"{'model':<10}{'path':<6}{'plain GB/s':>12}{'TLS GB/s':>10}{'time x':>8}{'plain CPU s/GB':>22}{'TLS CPU s/GB':>22}")
        for name, f in result["sizes"].items():
            for path, cost in f.get("tls", {}).items():
                plain, tls = cost["plain"], cost["tls"]
                cpu = [f"{c['cpu_s_per_gb']['client']:.2f} + {c['cpu_s_per_gb']['server']:.2f}" for c in (plain, tls)]
                print(f"{name:<10}{path:<6}{plain['gb_s']:>12}{tls['gb_s']:>10}{cost['time_ratio']:>8}{cpu[0]:>22}{cpu[1]:>22}")
