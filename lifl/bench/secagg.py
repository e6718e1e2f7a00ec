"""`lifl bench secagg`: a secure round (SecAgg+, docs/secure-aggregation.md) on a lifl node against
Flower 1.41's ``SecAggPlusWorkflow`` with ``secaggplus_mod``, same clients, model, degree, threshold
and dropouts, in one run; lifl's plain fixed-point round of the same updates is the reference for
what secure aggregation itself costs.

Each system's clients run as threads of one client process, so that the server's figures are
its processes' alone:

- lifl: a fresh node (agent, gateway, its Redis, aggregators: ``server_cpu_s`` is that process
  tree's), warmed for each N by an unmeasured plain round of N clients; every client runs
  ``Participant(secure=True)`` over HTTP; a dropout advertises and shares, then sends nothing
  (the costliest point to drop: its pairwise masks must be removed).
- Flower: the ServerApp's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` in a process
  of Flower's environment (lifl.bench.flower.flower_env), its grid handing each message, as
  Flower's protobuf, over a pipe to a client process that runs the ClientApp (``secaggplus_mod``)
  with each node's own Context; a dropout answers the setup and share stages, then nothing.
  There is no SuperLink: its CPU and the gRPC hops are left out of Flower's server figures.

Both systems wait out a stage's deadline (``--stage-timeout``; by default 0.5 s per client, at
least 10 s, as the clients share the machine's cores) when a client is missing, so a round with
dropouts includes one deadline. Fields per system: ``round_s`` (from the clients'
start to the new model), ``server_cpu_s``, ``client_cpu_s_p50`` (each client thread's CPU),
``client_bytes_up``/``client_bytes_down`` (the median client's, as its socket or pipe carried
them), ``server_peak_bytes`` (lifl: the largest sum of its processes' PSS; Flower: its process's
peak RSS) and ``unmask_s`` (from the unmask stage's start to the model); lifl's also
``unmasked_by``, the tasks that took masks off (each its own clients').
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

DEFAULT_CLIENTS = (20, 100, 500)
DEFAULT_DROPOUTS = (0.0, 0.1)
DEFAULT_PARAMETERS = 1_000_000
BIAS_PARAMETERS = 1000
FIXED_POINT = {"frac_bits": 16, "width": 32}  # masks modulo 2^32, as Flower's default modulus_range
FLOWER_QUANTIZATION_RANGE = 1 << 22
FLOWER_MODULUS_RANGE = 1 << 32
FLOWER_CLIPPING_RANGE = 8.0
UPDATE_SCALE = 0.01
MIN_STAGE_TIMEOUT_S = 10.0
STAGE_SECONDS_PER_CLIENT = 0.5  # the clients share this machine's cores: a stage of many needs longer
SAMPLE_INTERVAL_S = 0.25  # the node's memory (reading its processes' smaps costs CPU the round would use)
CLIENT_TIMEOUT_S = 1800.0
_FRAME = struct.Struct("!I")


# -- what both systems aggregate -------------------------------------------------------------------


def model_shapes(parameters: int) -> dict[str, tuple[int, ...]]:
    if parameters < 2 * BIAS_PARAMETERS:
        raise ValueError(f"--parameters must be at least {2 * BIAS_PARAMETERS}")
    return {"weight": (parameters - BIAS_PARAMETERS,), "bias": (BIAS_PARAMETERS,)}


def client_update(shapes: dict[str, tuple[int, ...]], client: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(client)
    return {k: (rng.standard_normal(s, dtype=np.float32) * UPDATE_SCALE).astype(np.float32) for k, s in shapes.items()}


def samples_of(client: int) -> int:
    return 10 + client % 10


def dropped_clients(clients: int, dropout: float) -> list[int]:
    """The clients that drop out after sharing: the same ones in both systems."""
    return sorted(int(i) for i in np.random.default_rng(12345).permutation(clients)[:round(clients * dropout)])


def expected_mean(shapes: dict[str, tuple[int, ...]], survivors: list[int]) -> dict[str, np.ndarray]:
    """The survivors' sample-weighted mean, in float64."""
    total = sum(samples_of(i) for i in survivors)
    out = {k: np.zeros(s, np.float64) for k, s in shapes.items()}
    for i in survivors:
        for k, v in client_update(shapes, i).items():
            out[k] += v * (samples_of(i) / total)
    return out


def max_abs_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want)


class _SocketBytes:
    """Bytes each thread's sockets sent and received, counted at the socket calls http.client
    makes (sendall, recv_into): the client process's instrument, installed once there."""

    def __init__(self) -> None:
        self.local = threading.local()
        sendall, recv_into = socket.socket.sendall, socket.socket.recv_into

        def counted_sendall(sock: socket.socket, data: Any, *args: Any) -> None:
            sendall(sock, data, *args)
            self.local.up = self.up() + memoryview(data).nbytes

        def counted_recv_into(sock: socket.socket, buffer: Any, *args: Any) -> int:
            n = recv_into(sock, buffer, *args)
            self.local.down = self.down() + n
            return n

        socket.socket.sendall, socket.socket.recv_into = counted_sendall, counted_recv_into  # type: ignore[method-assign]

    def up(self) -> int:
        return getattr(self.local, "up", 0)

    def down(self) -> int:
        return getattr(self.local, "down", 0)


def _p50(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


# -- lifl ----------------------------------------------------------------------------------------------


def lifl_clients(address: str, job: str, clients: int, dropped: list[int], parameters: int, secure: bool) -> dict[str, Any]:
    """Every client of one round, each a thread of this process (the client process); runs when a
    line arrives on stdin after "ready" was printed. Returns each survivor's CPU and bytes."""
    from lifl.client import Gateway, Participant
    from lifl.client.secure import SecureClient, share_with_peers

    shapes = model_shapes(parameters)
    go, quitting, counted = threading.Event(), set(dropped), _SocketBytes()
    results: dict[int, dict[str, Any]] = {}

    def client(i: int) -> None:
        name = f"c{i}"
        try:
            if i in quitting:
                gateway = Gateway(address)
                me = SecureClient(name)
                go.wait()
                view = gateway.secure_keys(job, *me.advertisement(), client=name)
                while view["stage"] == "advertise":
                    view = gateway.secure(job, name, after=(view["round"], "advertise"), wait_s=CLIENT_TIMEOUT_S)
                share_with_peers(gateway, job, me, view, name)
                gateway.close()
                return
            update = client_update(shapes, i)
            participant = Participant(address, job, client=name, secure=secure)
            go.wait()
            cpu, up, down = time.thread_time(), counted.up(), counted.down()
            outcome = participant.run_round(lambda state, version: (update, samples_of(i))).outcome
            results[i] = {"outcome": outcome, "cpu_s": time.thread_time() - cpu, "up": counted.up() - up,
                          "down": counted.down() - down}
            participant.close()
        except Exception as e:  # a failed client is a failed run: its error is reported, not swallowed
            results[i] = {"outcome": f"error: {e!r}"}

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for i in set(range(clients)) - quitting - set(results):
        results[i] = {"outcome": "still running"}
    return _client_figures(list(results.values()))


def _client_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r["outcome"] for r in results if r["outcome"] != "accepted"]
    ok = [r for r in results if r["outcome"] == "accepted"]
    return {"failed": failed[:5], "failures": len(failed),
            "client_cpu_s_p50": round(_p50([r["cpu_s"] for r in ok]), 4),
            "client_bytes_up": int(_p50([r["up"] for r in ok])), "client_bytes_down": int(_p50([r["down"] for r in ok]))}


@contextmanager
def _client_process(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The client process of ``argv``, once it printed "ready"; killed if still running after."""
    proc = subprocess.Popen([sys.executable, "-m", "lifl.bench.secagg", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the client process failed before starting:\n{proc.communicate()[1][-3000:]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _node_groups(sut: Any) -> dict[str, list[int]]:
    """The node's processes as ``lifl.bench.large.Peaks`` samples them: its aggregators, and the rest."""
    aggregators = sut.node.pids()["aggregators"]
    return {"aggregators": aggregators, "rest": [pid for pid in sut.pids() if pid not in aggregators]}


def _unmask_began(sut: Any, job: str) -> float:
    """When the done secure round's unmask stage began (seconds since the epoch, Redis's clock: this
    machine's): its deadline less the stage timeout, for the stage ended either by the last answer
    (which leaves the deadline) or at that deadline."""
    from lifl.secure_state import SecureRounds
    from lifl.state import secure_key

    r = SecureRounds(sut.state).round(job)
    assert r is not None and r.stage == "done", r
    timeout_ms = int(sut.state.redis.hget(secure_key(job), "timeout"))
    return (r.deadline_ms - timeout_ms) / 1000


def lifl_round(sut: Any, job: str, clients: int, dropout: float, parameters: int, secure: bool,
               stage_timeout_s: float) -> dict[str, Any]:
    """One round of a fresh job on the node ``sut`` (lifl.bench.compare.LiflUnderTest)."""
    from lifl import format as fmt
    from lifl.bench.large import Peaks
    from lifl.client import Gateway
    from lifl.kernels import validate
    from lifl.secure_state import SecureRounds

    shapes = model_shapes(parameters)
    dropped = dropped_clients(clients, dropout) if secure else []
    rounds = SecureRounds(sut.state) if secure else None  # made once: the wait loop reads the stage every 10 ms
    gateway = Gateway(sut.http, token=sut.token)
    fields: dict[str, Any] = {"fixed_point": FIXED_POINT}
    if secure:  # the degree is pinned through the dropout it tolerates: the job's, as Flower's num_shares below
        fields["secure_aggregation"] = {"dropout": max(dropout, 0.1), "corruption": 0.1, "stage_timeout_s": stage_timeout_s}
    gateway.create_job(job, clients, **fields)
    gateway.set_model(job, fmt.encode({n: np.zeros(s, np.float32) for n, s in shapes.items()}))
    env = {**os.environ, "LIFL_TOKEN": sut.token}
    argv = ["--lifl-clients", sut.http, "--job", job, "--clients", str(clients), "--parameters", str(parameters),
            "--dropped", ",".join(map(str, dropped))] + (["--secure"] if secure else [])
    try:
        with _client_process(argv, env) as proc, Peaks({"node": lambda: _node_groups(sut)}, lambda _: 0.0, SAMPLE_INTERVAL_S) as peaks:
            cpu, roles, t = sut.cpu_seconds(), sut.cpu_by_role(), time.time()
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while sut.version(job) < 1:
                if proc.poll() is not None and proc.returncode:
                    raise RuntimeError(f"the clients failed:\n{proc.communicate()[1][-3000:]}")
                if rounds is not None and (r := rounds.round(job)) is not None and r.stage == "abandoned":
                    raise RuntimeError(f"{job}'s secure round was abandoned: {r.why} (a longer --stage-timeout?)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{job}'s round did not end within {CLIENT_TIMEOUT_S:.0f} s")
                time.sleep(0.01)
            round_s, server_cpu_s = time.time() - t, sut.cpu_seconds() - cpu
            by_role = {role: round(v - roles[role], 3) for role, v in sut.cpu_by_role().items()}
            out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
            if proc.returncode:
                raise RuntimeError(f"the clients failed:\n{err[-3000:]}")
        figures = json.loads(out.strip().splitlines()[-1])
        blob = bytes(gateway.model(job)[1])
        model = {n: v.copy() for n, v in fmt.views(blob, validate(blob)).items()}
        record = gateway.rounds(job)[-1]
    finally:
        gateway.close()
    survivors = [i for i in range(clients) if i not in set(dropped)]
    result = {"round_s": round(round_s, 3), "server_cpu_s": round(server_cpu_s, 3), "server_cpu_by_role_s": by_role,
              **figures,
              "server_peak_bytes": int(peaks.rss),
              "max_abs_error": max_abs_error(model, expected_mean(shapes, survivors)), "model": model}
    if secure:
        result["unmask_s"] = round(t + round_s - _unmask_began(sut, job), 3)
        result["secure"] = record.get("secure")
        result["unmasked_by"] = _unmasked_by(sut, job)
    return result


def _unmasked_by(sut: Any, job: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Where the round's masks came off: each task that took streams off (its role, how many, and
    the seconds it took once told them), from the node's task reports (a task reports once it
    handed its result on, so the top's may come just after the model)."""
    from lifl.bench.dataplane import task_reports

    deadline = time.monotonic() + timeout
    while True:
        tasks = task_reports(sut.node.run_dir, job)
        if any(t["role"] == "top" for t in tasks) or time.monotonic() > deadline:
            return [{"role": t["role"], "streams": t["unmasked"], "s": round(t["unmask_s"], 3)}
                    for t in tasks if t.get("unmasked")]
        time.sleep(0.05)


# -- Flower (these run in Flower's environment) ------------------------------------------------------------


def _write_frame(stream: IO[bytes], data: bytes) -> None:
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes:
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError("the other side of the pipe closed it")
    return stream.read(_FRAME.unpack(head)[0])


def flower_clients(clients: int, dropped: list[int], parameters: int) -> None:
    """The Flower side's client process: node i + 1 is client i, a ClientApp with ``secaggplus_mod``
    and its own Context. Reads Flower protobuf messages as frames on stdin, answers each on stdout
    (an empty frame: a dropout, which answers nothing from the masked-vector stage on); an empty
    message ends it, and it writes its figures as a last frame."""
    from flwr.app import Context, RecordDict
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    shapes, quitting = model_shapes(parameters), {i + 1 for i in dropped}

    class Trained(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client = client

        def fit(self, parameters: Any, config: Any) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            update = client_update(shapes, self.client)
            return [update[k] for k in shapes], samples_of(self.client), {}

    app = ClientApp(client_fn=lambda context: Trained(context.node_id - 1).to_client(), mods=[secaggplus_mod])
    contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                for n in range(1, clients + 1)}
    figures = {n: {"outcome": "accepted", "cpu_s": 0.0, "up": 0, "down": 0} for n in contexts if n not in quitting}
    out, lock = sys.stdout.buffer, threading.Lock()

    def answer(data: bytes) -> None:
        cpu = time.thread_time()
        message = message_from_proto(ProtoMessage.FromString(data))
        node = message.metadata.dst_node_id
        stage = message.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        reply = b""
        if node not in quitting or stage in (Stage.SETUP, Stage.SHARE_KEYS):
            reply = message_to_proto(app(message, contexts[node])).SerializeToString()
        if node in figures:
            figures[node]["cpu_s"] += time.thread_time() - cpu
            figures[node]["down"] += _FRAME.size + len(data)
            figures[node]["up"] += _FRAME.size + len(reply)
        with lock:
            _write_frame(out, reply)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        _write_frame(out, b"ready")
        while data := _read_frame(sys.stdin.buffer):
            pool.submit(answer, data)
    _write_frame(out, json.dumps(_client_figures(list(figures.values()))).encode())


def flower_round(clients: int, dropped: list[int], parameters: int, num_shares: int, threshold: int,
                 stage_timeout_s: float) -> dict[str, Any]:
    """The Flower side's server process: one round of ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow)``
    over a grid whose nodes are the client process's (``flower_clients``)."""
    import resource

    from flwr.app import Context, RecordDict
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.server import LegacyContext, ServerConfig
    from flwr.compat.common.recorddict_compat import arrayrecord_to_parameters
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    from lifl.bench.flowermem import _status_mb, in_process_grid, reset_peak

    shapes = model_shapes(parameters)
    proc = subprocess.Popen([sys.executable, "-m", "lifl.bench.secagg", "--flower-clients", "--clients", str(clients),
                             "--parameters", str(parameters), "--dropped", ",".join(map(str, dropped))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    to_clients, from_clients = proc.stdin, proc.stdout
    if _read_frame(from_clients) != b"ready":
        raise RuntimeError("Flower's client process did not start")

    def exchange(pulled: list[tuple[int, Any]]) -> list[Any]:
        for _, message in pulled:
            _write_frame(to_clients, message_to_proto(message).SerializeToString())
        replies = (_read_frame(from_clients) for _ in pulled)
        return [message_from_proto(ProtoMessage.FromString(r)) for r in replies if r]

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    timings: dict[str, float] = {}

    class Timed(SecAggPlusWorkflow):
        def __call__(self, grid: Any, context: Any) -> None:
            timings["baseline_mb"] = reset_peak()
            t, cpu = time.time(), cpu_s()
            super().__call__(grid, context)
            timings["round_s"], timings["server_cpu_s"] = time.time() - t, cpu_s() - cpu
            timings["peak_mb"] = _status_mb("VmHWM")

        def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
            t = time.time()
            done = super().unmask_stage(grid, context, state)
            timings["unmask_s"] = time.time() - t
            return done

    zeros = [np.zeros(s, np.float32) for s in shapes.values()]
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients, min_available_clients=clients,
                      initial_parameters=ndarrays_to_parameters(zeros))
    context = LegacyContext(context=Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=Timed(num_shares=num_shares, reconstruction_threshold=threshold,
                                                  clipping_range=FLOWER_CLIPPING_RANGE,
                                                  quantization_range=FLOWER_QUANTIZATION_RANGE,
                                                  modulus_range=FLOWER_MODULUS_RANGE, timeout=stage_timeout_s))
    workflow(in_process_grid(clients, exchange), context)
    _write_frame(to_clients, b"")
    figures = json.loads(_read_frame(from_clients))
    proc.wait()
    if "round_s" not in timings or "unmask_s" not in timings:
        raise RuntimeError("Flower's SecAgg+ round did not complete")
    got = dict(zip(shapes, parameters_to_ndarrays(arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD],
                                                                            keep_input=True))))
    survivors = [i for i in range(clients) if i not in set(dropped)]
    return {"round_s": round(timings["round_s"], 3), "server_cpu_s": round(timings["server_cpu_s"], 3), **figures,
            "server_peak_bytes": int(timings["peak_mb"] * (1 << 20)),
            "server_peak_above_idle_bytes": int((timings["peak_mb"] - timings["baseline_mb"]) * (1 << 20)),
            "unmask_s": round(timings["unmask_s"], 3), "max_abs_error": max_abs_error(got, expected_mean(shapes, survivors))}


# -- a client's masking against its floor ------------------------------------------------------------------


def masking(parameters: int, degree: int, reps: int = 3) -> dict[str, Any]:
    """A client's masking (its update in fixed point plus its self mask and ``degree`` pairwise
    masks: ``lifl.secagg.plain_input`` and ``add_masks``) against the physical floor, the bare
    AES-256-CTR keystreams of as many seeds over the same bytes; the best of ``reps`` each."""
    import secrets

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from lifl import format as fmt
    from lifl import secagg
    from lifl.fixedpoint import FixedPoint

    shapes = model_shapes(parameters)
    spec = fmt.ModelSpec(tuple(fmt.TensorSpec(n, fmt.F32, s) for n, s in shapes.items()))
    update, fixed_point = client_update(shapes, 0), FixedPoint.from_request(FIXED_POINT)
    assert fixed_point is not None
    seeds = [(1 if i % 2 else -1, secrets.token_bytes(32)) for i in range(degree + 1)]
    masked_s, floor_s = [], []
    for _ in range(reps):
        t = time.perf_counter()
        blob = secagg.plain_input(update, samples_of(0), spec, fixed_point, 1000)
        secagg.add_masks(secagg.segments(blob), seeds)
        masked_s.append(time.perf_counter() - t)
        size = sum(s.nbytes for s in secagg.segments(blob))
        zeros, keystream = np.zeros(size, np.uint8), np.empty(size + 15, np.uint8)
        t = time.perf_counter()
        for _, seed in seeds:
            Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update_into(zeros, keystream)
        floor_s.append(time.perf_counter() - t)
    return {"streams": degree + 1, "bytes": size, "masking_s": round(min(masked_s), 4),
            "expansion_floor_s": round(min(floor_s), 4), "ratio": round(min(masked_s) / min(floor_s), 2)}


# -- the bench -------------------------------------------------------------------------------------------


def run(clients: tuple[int, ...] = DEFAULT_CLIENTS, dropouts: tuple[float, ...] = DEFAULT_DROPOUTS,
        parameters: int = DEFAULT_PARAMETERS, stage_timeout_s: float | None = None, flower: bool = True,
        say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from lifl import secagg
    from lifl.bench.compare import LiflUnderTest
    from lifl.bench.flower import flower_env
    from lifl.net.limits import ConnectionLimits

    python = flower_env() / "python" if flower else None
    out: dict[str, Any] = {"parameters": parameters, "fixed_point": FIXED_POINT, "runs": []}
    with tempfile.TemporaryDirectory(prefix="lifl-secagg-") as tmp, open(Path(tmp) / "node.log", "w") as log:
        os.chmod(tmp, 0o755)  # the node's redis and gateway run as its service user
        # every client holds a connection between stages, and all of them come from this machine's address
        connections = 2 * max(clients) + 64
        sut = LiflUnderTest(Path(tmp), log, ConnectionLimits(max_connections=connections, max_per_peer=connections))
        try:
            for n in clients:
                timeout = stage_timeout_s or max(MIN_STAGE_TIMEOUT_S, n * STAGE_SECONDS_PER_CLIENT)
                lifl_round(sut, f"warmup{n}", n, 0.0, parameters, False, 0.0)  # the aggregators N needs, started
                plain = lifl_round(sut, f"plain{n}", n, 0.0, parameters, False, 0.0)
                plain_model = plain.pop("model")
                say(f"N={n} lifl plain fixed point: {plain['round_s']} s, server CPU {plain['server_cpu_s']} s")
                for dropout in dropouts:
                    params = secagg.choose_params(n, max(dropout, 0.1), 0.1)
                    row: dict[str, Any] = {"clients": n, "dropout": dropout, "k": params.k, "threshold": params.threshold,
                                           "stage_timeout_s": timeout, "lifl_plain": plain}
                    lifl = lifl_round(sut, f"secure{n}d{round(dropout * 100)}", n, dropout, parameters, True, timeout)
                    model = lifl.pop("model")
                    if not dropout:  # no dropout: the masked round's model is the plain round's, bit for bit
                        lifl["exact"] = all(model[k].tobytes() == plain_model[k].tobytes() for k in plain_model)
                    row["lifl"] = lifl
                    say(f"N={n} dropout {dropout:.0%} lifl secure: {lifl['round_s']} s, server CPU {lifl['server_cpu_s']} s")
                    if python is not None:
                        row["flower"] = _flower(python, n, dropout, parameters, min(params.k + 1, n), params.threshold,
                                                timeout)
                        say(f"N={n} dropout {dropout:.0%} Flower SecAgg+: {row['flower']['round_s']} s, "
                            f"server CPU {row['flower']['server_cpu_s']} s")
                    row["ratios"] = _ratios(row)
                    out["runs"].append(row)
        finally:
            sut.stop()
    top = max(clients)
    out["masking"] = masking(parameters, secagg.choose_params(top, 0.1, 0.1).k)
    return out


def _flower(python: Path, clients: int, dropout: float, parameters: int, num_shares: int, threshold: int,
            stage_timeout_s: float) -> dict[str, Any]:
    argv = [str(python), "-m", "lifl.bench.secagg", "--flower-server", "--clients", str(clients), "--parameters",
            str(parameters), "--dropped", ",".join(map(str, dropped_clients(clients, dropout))), "--num-shares",
            str(num_shares), "--threshold", str(threshold), "--stage-timeout", str(stage_timeout_s)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"Flower's SecAgg+ round failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratios(row: dict[str, Any]) -> dict[str, float]:
    lifl, plain = row["lifl"], row["lifl_plain"]
    out = {"secure_over_plain_server_cpu": round(lifl["server_cpu_s"] / plain["server_cpu_s"], 2)}
    if flower := row.get("flower"):
        out["server_cpu_over_flower"] = round(lifl["server_cpu_s"] / flower["server_cpu_s"], 3)
        out["round_over_flower"] = round(lifl["round_s"] / flower["round_s"], 3)
    return out


def _listed(convert: Callable[[str], Any], what: str, valid: Callable[[Any], bool], rule: str
            ) -> Callable[[str], tuple[Any, ...]]:
    """An argument type: a comma-separated list of ``what``, each ``valid`` (else ``rule`` is said)."""
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(convert(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma-separated list of {what}, got {text!r}") from None
        if not all(valid(v) for v in values):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return values

    return parse


_counts = _listed(int, "client counts", lambda n: n >= 3, "each client count must be at least 3")
_fractions = _listed(float, "dropout fractions", lambda d: 0.0 <= d < 0.5, "each dropout fraction must be in [0, 0.5)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=_counts, default=DEFAULT_CLIENTS, help="clients per round, comma-separated (default 20,100,500)")
    p.add_argument("--dropouts", type=_fractions, default=DEFAULT_DROPOUTS,
                   help="fractions of the clients that drop out after sharing, comma-separated (default 0,0.1)")
    p.add_argument("--parameters", type=int, default=DEFAULT_PARAMETERS, help="the model's parameters (default 1,000,000)")
    p.add_argument("--stage-timeout", type=float, default=None,
                   help="each stage's deadline in seconds, both systems (default: 0.5 s per client, at least 10): a "
                        "round with dropouts waits one")
    p.add_argument("--no-flower", action="store_true", help="lifl only (Flower's environment is not made)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.parameters < 2 * BIAS_PARAMETERS:
        raise SystemExit(f"--parameters must be at least {2 * BIAS_PARAMETERS}")
    if args.stage_timeout is not None and not 1.0 <= args.stage_timeout <= 600.0:
        raise SystemExit("--stage-timeout must be between 1 and 600 seconds")
    result = run(args.clients, args.dropouts, args.parameters, args.stage_timeout, not args.no_flower,
                 say=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
        return 0
    for row in result["runs"]:
        print(f"N={row['clients']} dropout {row['dropout']:.0%}: {row['ratios']}")
    print(f"masking: {result['masking']}")
    return 0


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m lifl.bench.secagg")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--lifl-clients", metavar="GATEWAY")
    role.add_argument("--flower-clients", action="store_true")
    role.add_argument("--flower-server", action="store_true")
    p.add_argument("--job", default="")
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--parameters", type=int, required=True)
    p.add_argument("--dropped", default="")
    p.add_argument("--secure", action="store_true")
    p.add_argument("--num-shares", type=int, default=0)
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--stage-timeout", type=float, default=MIN_STAGE_TIMEOUT_S)
    args = p.parse_args(argv)
    dropped = [int(v) for v in args.dropped.split(",") if v]
    if args.flower_clients:
        flower_clients(args.clients, dropped, args.parameters)
    elif args.flower_server:
        print(json.dumps(flower_round(args.clients, dropped, args.parameters, args.num_shares, args.threshold,
                                      args.stage_timeout)))
    else:
        print(json.dumps(lifl_clients(args.lifl_clients, args.job, args.clients, dropped, args.parameters, args.secure)))


if __name__ == "__main__":
    _child(sys.argv[1:])
