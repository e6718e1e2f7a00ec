"""`lifl bench large`: a round of updates larger than one aggregator should hold.

A model of ``--parameters`` bf16 parameters (default 1e9: 2 GB per update), cut into a few
LLM-like tensors, and ``--clients`` updates generated into files (random normal values, seeded)
that each client streams from disk through a resumable upload (``Gateway.push_file``: sendfile,
never read into memory). One run
measures, on fresh nodes:

- ``unsharded``: lifl on one node, every aggregator folding whole updates;
- ``sharded``: lifl on one node with ``--shards`` M tensor shards;
- ``sharded_f32``: the same with float32 accumulators;
- ``lean``: lifl on one node, unsharded, with float32 accumulators, one leaf for every update
  (``leaf_fan_in`` = clients) and ``max_inflight`` 2: the node holds two updates, the model and
  the accumulator, the other clients wait their turn (503 and a retry);
- ``split``: ``lifl up --nodes N`` (network namespaces on this machine, each node ``1/N`` of the
  shared memory) with the job's ``--shards`` M split across them (docs/sharding.md): every
  client sends each node its part of its file (``SplitJob.push_file``), each node aggregates
  its shards; its peaks are the largest node's, and ``split_peak_ratio`` compares them with the
  unsharded node's (needs root);
- ``flower``: Flower 1.41's FedAvg in a process of Flower's environment, on the same replies
  widened to float32 (numpy has no bfloat16 arithmetic: Flower aggregates what numpy computes
  on), pulled from an in-process grid as a ServerApp pulls them from the SuperLink. Its
  address space is capped at ``FLOWER_MEMORY_FRACTION`` of the machine's available memory
  beyond what it held before the round, so a round it cannot hold fails with MemoryError
  instead of taking the machine: then it reports ``completed`` false and how many replies it
  held.

Each system reports ``round_s`` (first byte pushed to the new version installed), ``ingest_gbps``
(update bytes over the time until every push was acknowledged), ``aggregate_gbps`` (update
bytes folded per CPU second of the leaves' folds: one core's fold bandwidth, against
``memcpy_gbps``, numpy copying an update's bytes in the same run), the node's peaks sampled
every 50 ms (``peak_shm_bytes_per_node``: the store's objects; ``peak_rss_bytes_per_node``: the
proportional set size of its gateway, agent and aggregators, shared memory counted once;
``peak_aggregator_rss_bytes``: the largest of one aggregator), and ``max_abs_error`` of the
model against float64 FedAvg computed slice by slice from the files. ``resume`` pushes one
update through a TCP proxy that cuts the connection once half the file crossed it: the SDK
resumes by itself, and ``resume_overhead_bytes`` is what it sent beyond the file's size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.errors import Unprocessable
from lifl.procstat import meminfo_bytes

GB = 1e9
SAMPLE_INTERVAL_S = 0.05
ROWS = 4096  # a tensor's row: the model is a few (rows x 4096) matrices and a remainder vector
TENSORS = 8
CHUNK_ELEMENTS = 1 << 24  # generation and checking go through this many elements at a time
SHM_CAPACITY = 20 << 30  # the node's --shm-limit, or less if /dev/shm has less free
FLOWER_MEMORY_FRACTION = 0.75  # of MemAvailable: what Flower's round may take before it counts as out of memory
FLOWER_TIMEOUT_S = 3600  # bounds a failure only
PUSH_PATIENCE_S = 1800  # seconds (and tries) a client keeps asking while the lean job's max_inflight keeps it waiting
NODE_STEM, CLUSTER_PREFIX, CLUSTER_SUBNET = "lg", "liflg", "10.83.0.0/24"  # the split system's cluster


LEAN_INFLIGHT = 2  # the lean system's max_inflight: updates held at once besides the accumulator
SYSTEMS: dict[str, Callable[[int, int], dict[str, Any]]] = {  # lifl's, by their job fields for M shards and N clients
    "unsharded": lambda shards, clients: {},
    "sharded": lambda shards, clients: {"shards": shards},
    "sharded_f32": lambda shards, clients: {"shards": shards, "accumulator": "float32"},
    # one leaf folds every update as it comes, two in flight at a time: memory over parallelism
    "lean": lambda shards, clients: {"accumulator": "float32", "leaf_fan_in": clients, "max_inflight": LEAN_INFLIGHT},
}


def model_tensors(parameters: int) -> list[tuple[str, fmt.DType, tuple[int, ...]]]:
    rows = parameters // (TENSORS * ROWS)
    tensors = [(f"layers.{i}.weight", fmt.BF16, (rows, ROWS)) for i in range(TENSORS) if rows]
    rest = parameters - TENSORS * rows * ROWS
    return tensors + ([("head.bias", fmt.BF16, (rest,))] if rest else [])


def _to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_update(path: Path, tensors: list[tuple[str, fmt.DType, tuple[int, ...]]], seed: int | None) -> int:
    """An update file: random normal values (``seed`` None: zeros, the initial model)."""
    header = fmt.encode_header(tensors)
    elements = sum(fmt.TensorSpec(*t).numel for t in tensors)
    rng = np.random.default_rng(seed) if seed is not None else None
    with open(path, "wb") as f:
        f.write(header)
        for start in range(0, elements, CHUNK_ELEMENTS):
            n = min(CHUNK_ELEMENTS, elements - start)
            f.write((_to_bf16(rng.standard_normal(n, np.float32)) if rng else np.zeros(n, np.uint16)).tobytes())
    return len(header) + 2 * elements


def shm_capacity() -> int:
    """Most of /dev/shm's free space (the round's objects live there), at most SHM_CAPACITY."""
    st = os.statvfs("/dev/shm")
    return min(SHM_CAPACITY, int(st.f_bavail * st.f_frsize * 0.85))


def memcpy_gbps(nbytes: int) -> float:
    """numpy copying ``nbytes`` (best of three), for the fold bandwidth's reference."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / GB


class Peaks:
    """Nodes' memory, sampled on a thread until stopped: the largest peaks of any one of them.
    ``nodes`` maps each node to what gives its processes (``{"aggregators": [...], other roles}``
    of ``Node.pids``), ``shm_used`` to its store's bytes in use; every ``interval`` seconds."""

    def __init__(self, nodes: dict[str, Callable[[], dict[str, list[int]]]], shm_used: Callable[[str], float],
                 interval: float = SAMPLE_INTERVAL_S) -> None:
        self.nodes, self.shm_used, self.interval = nodes, shm_used, interval
        self.shm = self.rss = self.aggregator = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from lifl.procstat import pss_mb

        while not self._stop.is_set():
            for node, pids in self.nodes.items():
                groups = pids()
                self.rss = max(self.rss, pss_mb([pid for group in groups.values() for pid in group]) * (1 << 20))
                self.aggregator = max([self.aggregator, *(pss_mb([pid]) * (1 << 20) for pid in groups["aggregators"])])
                self.shm = max(self.shm, self.shm_used(node))
            self._stop.wait(self.interval)


def namespace_pids_of(namespace: str, supervisor: int) -> dict[str, list[int]]:
    """A cluster node's processes: those of its network namespace but its supervisor, the
    aggregators being its agent's children."""
    from lifl.node.netns import namespace_pids
    from lifl.procstat import children

    aggregators = [pid for parent in children(supervisor) for pid in children(parent)]
    others = [pid for pid in namespace_pids(namespace) if pid != supervisor and pid not in aggregators]
    return {"aggregators": aggregators, "node": others}


def _timed_round(push: Callable[[int], None], clients: int, errors: list[BaseException], version: Callable[[], int]
                 ) -> tuple[float, float]:
    """Every client pushing its update at once (``push(i)``, which records a failure in
    ``errors``): seconds until every push was acknowledged, and until version 1 was installed."""
    t0 = time.perf_counter()
    pushers = [threading.Thread(target=push, args=(i,)) for i in range(clients)]
    for t in pushers:
        t.start()
    for t in pushers:
        t.join()
    ingested = time.perf_counter() - t0
    if errors:
        raise errors[0]
    while version() < 1:
        time.sleep(0.02)
    return ingested, time.perf_counter() - t0


def _shm_used(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('lifl_shm_bytes{state="used"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[tuple[mmap.mmap, memoryview]]:
    """A file mapped read-only, and a view of it. Slices of the view that outlive it (held by an
    exception's traceback) keep the mapping open: it goes with the last of them."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    try:
        yield mm, view
    finally:
        with contextlib.suppress(BufferError):
            view.release()
            mm.close()


def _values(buffer: Any, offset: int, n: int) -> np.ndarray:
    """bf16 elements as float64 (a copy: no view of the buffer outlives the call)."""
    return _from_bf16(np.frombuffer(buffer, np.uint16, n, offset)).astype(np.float64)


def max_abs_error(model: bytes, files: list[Path], samples: list[int]) -> float:
    """The largest |model - float64 FedAvg| over the elements, computed a slice at a time."""
    layout = fmt.parse_layout(model)
    elements = layout.data_len // 2
    with contextlib.ExitStack() as stack:
        maps = [stack.enter_context(_mapped(path))[0] for path in files]
        worst = 0.0
        for first in range(0, elements, CHUNK_ELEMENTS):
            n = min(CHUNK_ELEMENTS, elements - first)
            offset = layout.data_start + 2 * first  # the files share the model's header, hence its layout
            mean = sum(s * _values(mm, offset, n) for mm, s in zip(maps, samples)) / sum(samples)
            worst = max(worst, float(np.abs(_values(model, offset, n) - mean).max()))
        return worst


@contextlib.contextmanager
def _node(root: Path, shm_capacity: int, uploads: int) -> Iterator[tuple[Any, str]]:
    """A fresh node in ``root`` taking ``uploads`` uploads at once from one principal: (node, its HTTP address)."""
    from lifl.net.limits import ConnectionLimits
    from lifl.node.supervisor import Node, NodeConfig

    root.mkdir()
    with open(root / "node.log", "w") as log:
        node = Node(NodeConfig(node=f"lg{os.getpid() % 10000}{root.name[:4]}", http="127.0.0.1:0", grpc="127.0.0.1:0",
                               run_dir=root / "run", data_dir=root / "data", shm_capacity=shm_capacity,
                               gateway_limits=ConnectionLimits(max_uploads_per_principal=uploads)), log=log)
        try:
            yield node, node.start().http
        finally:
            node.stop()


def resume_overhead(update: Path, model_file: Path, workdir: Path, shm_capacity: int) -> dict[str, Any]:
    """One update pushed through a connection cut once its first half crossed: the file's bytes
    the SDK sent beyond the file (what went again after the cut), and the resumes it made."""
    from lifl.bench.cutting import UP, CuttingProxy
    from lifl.client import Gateway

    size = update.stat().st_size
    with _node(workdir / "resume", shm_capacity, 1) as (node, http):
        gw = Gateway(http, token=node.operator_token)
        proxy = CuttingProxy(http, cut_after=size // 2, direction=UP)
        client = Gateway(proxy.address, token=node.operator_token)
        try:
            gw.create_job("resume", 1)
            with _mapped(model_file) as (_, view):
                gw.set_model("resume", view)
            answer = client.push_file("resume", update, client="c0", samples=1, base_version=0)
        finally:
            client.close()
            proxy.close()
            gw.close()
    return {"resume_overhead_bytes": answer["sent_bytes"] - size, "resume_overhead_ratio": round(answer["sent_bytes"] / size - 1, 6),
            "resumes": answer["resumes"], "cuts": proxy.cut}


def run_system(name: str, files: list[Path], model_file: Path, samples: list[int], fields: dict[str, Any],
               workdir: Path, shm_capacity: int) -> dict[str, Any]:
    from lifl.client import Gateway
    from lifl.client.gateway import RetryPolicy
    from lifl.bench.dataplane import task_reports

    update_bytes = files[0].stat().st_size
    root = workdir / name
    with _node(root, shm_capacity, len(files)) as (node, http):
        gw = Gateway(http, token=node.operator_token)
        try:
            gw.create_job("large", len(files), **fields)
            with _mapped(model_file) as (_, view):
                try:
                    gw.set_model("large", view)
                except Unprocessable as e:  # the node cannot hold the round: what it would need is the result
                    if e.code != "round_too_large":
                        raise
                    return {"refused": e.code, "needed_bytes": e.extra["needed"], "available_bytes": e.extra["available"]}
            errors: list[BaseException] = []

            def push(i: int) -> None:  # a client the node asks to wait (max_inflight) waits its turn
                patient = RetryPolicy(max_attempts=PUSH_PATIENCE_S, max_elapsed_s=PUSH_PATIENCE_S)
                client = Gateway(http, token=node.operator_token, retry=patient)
                try:
                    client.push_file("large", files[i], client=f"c{i}", samples=samples[i], base_version=0)
                except BaseException as e:
                    errors.append(e)
                finally:
                    client.close()

            watcher = Gateway(http, token=node.operator_token)  # its own connection: a client is not shared by threads
            with Peaks({"node": node.pids}, lambda _: _shm_used(watcher.metrics())) as peaks:
                ingested, round_s = _timed_round(push, len(files), errors, lambda: gw.job("large")["version"])
            watcher.close()
            tasks = task_reports(root / "run", "large")
            leaves = [t for t in tasks if t["role"] == "leaf" and t["folds"]]
            fold_s = sum(t["agg_cpu_s"] for t in leaves)  # CPU, not wall time: the shards' leaves share the cores
            folded = sum(t["inputs"] * t["bytes"] for t in leaves)  # "bytes": of the model (its shard) in update dtypes
            version, model = gw.model("large")
            return {
                "round_s": round(round_s, 2),
                "ingest_gbps": round(len(files) * update_bytes / ingested / GB, 3),
                "aggregate_gbps": round(folded / fold_s / GB, 3) if fold_s else None,
                "peak_shm_bytes_per_node": int(peaks.shm),
                "peak_rss_bytes_per_node": int(peaks.rss),
                "peak_aggregator_rss_bytes": int(peaks.aggregator),
                "max_abs_error": max_abs_error(model, files, samples),
                "tasks": {role: sum(t["role"] == role for t in tasks) for role in ("leaf", "middle", "top")},
            }
        finally:
            gw.close()


def split_system(nodes: int, shards: int, files: list[Path], model_file: Path, samples: list[int], workdir: Path,
                 shm_capacity: int) -> dict[str, Any]:
    """The round on ``nodes`` nodes of one cluster, the job's ``shards`` split across them."""
    from lifl.client import Gateway, SplitJob
    from lifl.client.gateway import RetryPolicy
    from lifl.net.limits import ConnectionLimits
    from lifl.node.cluster import Cluster, ClusterConfig

    root = workdir / "split"
    root.mkdir()
    with open(root / "cluster.log", "w") as log:  # not stdout: --json prints there
        cluster = Cluster(ClusterConfig(nodes=nodes, node_stem=NODE_STEM, prefix=CLUSTER_PREFIX, subnet=CLUSTER_SUBNET,
                                        run_dir=root / "run", data_dir=root / "data", shm_capacity=shm_capacity // nodes,
                                        gateway_limits=ConnectionLimits(max_uploads_per_principal=len(files))),
                          log=log)
        update_bytes = files[0].stat().st_size
        try:
            addresses = cluster.start()
            token = cluster.operator_token
            http = {node: a.http for node, a in addresses.nodes.items()}
            gw = Gateway(http[min(http)], token=token)
            gw.create_job("large", len(files), shards=shards)
            with _mapped(model_file) as (_, view):
                gw.set_model("large", view)
            errors: list[BaseException] = []

            def push(i: int) -> None:  # each client its own connections: a Gateway is not shared by threads
                patient = RetryPolicy(max_attempts=PUSH_PATIENCE_S, max_elapsed_s=PUSH_PATIENCE_S)
                try:
                    with SplitJob(Gateway(http[min(http)], retry=patient, token=token), "large") as job:
                        job.push_file(files[i], client=f"c{i}", samples=samples[i], base_version=0)
                except BaseException as e:
                    errors.append(e)

            watchers = {node: Gateway(address, token=token) for node, address in http.items()}
            processes = {node: functools.partial(namespace_pids_of, cluster.network.namespace(node),
                                                 cluster.nodes[node].proc.pid) for node in http}
            with Peaks(processes, lambda node: _shm_used(watchers[node].metrics())) as peaks:
                ingested, round_s = _timed_round(push, len(files), errors, lambda: gw.job("large")["version"])
            for watcher in watchers.values():
                watcher.close()
            with SplitJob(gw, "large") as job:
                _, model = job.model()
            gw.close()
            return {
                "nodes": nodes,
                "round_s": round(round_s, 2),
                "ingest_gbps": round(len(files) * update_bytes / ingested / GB, 3),
                "peak_shm_bytes_per_node": int(peaks.shm),
                "peak_rss_bytes_per_node": int(peaks.rss),
                "peak_aggregator_rss_bytes": int(peaks.aggregator),
                "max_abs_error": max_abs_error(bytes(model), files, samples),
            }
        finally:
            cluster.stop()


def flower_system(files: list[Path], model_file: Path, samples: list[int], limit_bytes: int) -> dict[str, Any]:
    """Flower's FedAvg on the same replies, in a process of Flower's environment (``flower_round``)."""
    import subprocess

    from lifl.bench.flower import flower_env

    argv = [str(flower_env() / "python"), "-m", "lifl.bench.large", json.dumps(
        {"files": [str(f) for f in files], "model": str(model_file), "samples": samples, "limit_bytes": limit_bytes})]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=FLOWER_TIMEOUT_S, env={**os.environ, "PYTHONPATH": ""})
    if done.returncode:  # out of memory where Python could not raise (a C library's abort), or a failure
        return {"completed": False, "failed": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}",
                "limit_bytes": limit_bytes}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _float32_arrays(path: Path) -> dict[str, np.ndarray]:
    """An update file's tensors widened from bf16 to float32, read (not mapped: a capped address
    space then fails the way a server receiving them would, with MemoryError)."""
    with open(path, "rb") as f:
        layout = fmt.parse_header(f.read(fmt.header_length(f.read(fmt.PREFIX_BYTES))))
        out = {}
        for entry in layout.entries:
            t = entry.spec
            bits = np.fromfile(f, np.uint16, t.numel, offset=layout.data_start + entry.begin - f.tell())
            out[t.name] = _from_bf16(bits).reshape(t.shape)
    return out


def flower_round(files: list[Path], model_file: Path, samples: list[int], limit_bytes: int) -> dict[str, Any]:
    """One round of Flower 1.41's FedAvg in this process (Flower's environment): the replies made
    from the files as they are pulled, the address space capped at ``limit_bytes`` beyond what
    the process holds once the global model is in."""
    import resource

    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from lifl.bench.flowermem import _status_mb, reset_peak, synthetic_grid

    held = 0

    def answer(position: int, _: Any) -> RecordDict:
        nonlocal held
        arrays = ArrayRecord({name: Array(values) for name, values in _float32_arrays(files[position]).items()})
        held += 1
        return RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": samples[position]})})

    n = len(files)
    fedavg = FedAvg(fraction_train=1.0, min_train_nodes=n, min_available_nodes=n, fraction_evaluate=0.0)
    grid = synthetic_grid({}, n, answer=answer)
    model = ArrayRecord({name: Array(values) for name, values in _float32_arrays(model_file).items()})
    messages = list(fedavg.configure_train(1, model, ConfigRecord(), grid))
    virtual = int(_status_mb("VmSize") * (1 << 20))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)  # the soft limit only: raising it back needs no privilege
    resource.setrlimit(resource.RLIMIT_AS, (virtual + limit_bytes, hard))
    baseline = reset_peak()
    t = time.perf_counter()
    try:
        aggregated, _ = fedavg.aggregate_train(1, grid.send_and_receive(messages, timeout=None))
        completed = aggregated is not None
    except MemoryError:
        completed = False
    seconds = time.perf_counter() - t
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    peak = _status_mb("VmHWM")
    return {"completed": completed, "replies_held": held, "round_s": round(seconds, 2) if completed else None,
            "peak_rss_bytes": int(peak * (1 << 20)), "peak_above_baseline_bytes": int((peak - baseline) * (1 << 20)),
            "limit_bytes": limit_bytes}


def run(parameters: int, clients: int, shards: int, say: Callable[[str], None] = lambda _: None,
        workdir: Path | None = None, nodes: int = 4) -> dict[str, Any]:
    tensors = model_tensors(parameters)
    with tempfile.TemporaryDirectory(prefix="lifl-large-", dir=workdir) as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)  # the node's gateway and redis run as its service user
        files = [root / f"update{i}.safetensors" for i in range(clients)]
        update_bytes = 0
        for i, path in enumerate(files):
            update_bytes = write_update(path, tensors, seed=i)
        model_file = root / "model.safetensors"
        write_update(model_file, tensors, seed=None)
        say(f"{parameters:,} bf16 parameters: {clients} updates of {update_bytes / GB:.2f} GB generated")
        samples = [100 + 10 * i for i in range(clients)]
        out: dict[str, Any] = {"parameters": parameters, "clients": clients, "shards": shards, "nodes": nodes,
                               "update_bytes": update_bytes,
                               "memcpy_gbps": round(memcpy_gbps(update_bytes), 3)}
        capacity = shm_capacity()
        for name in SYSTEMS:
            out[name] = run_system(name, files, model_file, samples, SYSTEMS[name](shards, clients), root, capacity)
            say(f"{name}: {out[name]}")
        if nodes > 1:
            out["split"] = split_system(nodes, shards, files, model_file, samples, root, capacity)
            say(f"split: {out['split']}")
            if "refused" not in out["unsharded"]:
                out["split_peak_ratio"] = round(out["split"]["peak_rss_bytes_per_node"]
                                                / out["unsharded"]["peak_rss_bytes_per_node"], 3)
        out["resume"] = resume_overhead(files[0], model_file, root, capacity)
        say(f"resume: {out['resume']}")
        out["flower"] = flower_system(files, model_file, samples, int(FLOWER_MEMORY_FRACTION * meminfo_bytes("MemAvailable")))
        say(f"flower: {out['flower']}")
        if out["flower"]["completed"]:  # lifl's node against Flower's server process
            out["flower_peak_ratio"] = {name: round(out[name]["peak_rss_bytes_per_node"] / out["flower"]["peak_rss_bytes"], 3)
                                        for name in SYSTEMS if "refused" not in out[name]}
        unsharded, sharded = out["unsharded"], out["sharded"]
        if "refused" not in unsharded and "refused" not in sharded:
            out["sharded_round_ratio"] = round(sharded["round_s"] / unsharded["round_s"], 3)
            out["sharded_aggregator_rss_ratio"] = round(sharded["peak_aggregator_rss_bytes"]
                                                        / max(unsharded["peak_aggregator_rss_bytes"], 1), 3)
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parameters", type=float, default=1e9, help="bf16 parameters of the model (default 1e9: 2 GB)")
    p.add_argument("--clients", type=int, default=8, help="updates in the round (default 8)")
    p.add_argument("--shards", type=int, default=4, help="tensor shards of the sharded runs (default 4)")
    p.add_argument("--nodes", type=int, default=4, help="nodes of the split system (default 4; 1: none, it needs root)")
    p.add_argument("--workdir", type=Path, help="where the update files go (default: the temporary directory)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.parameters < 1 or args.clients < 1 or not 2 <= args.shards <= 64 or not 1 <= args.nodes <= args.shards:
        raise SystemExit("--parameters and --clients must be at least 1, --shards between 2 and 64, --nodes between 1 "
                         "and --shards")
    if args.nodes > 1 and os.geteuid() != 0:
        raise SystemExit("--nodes above 1 runs nodes in network namespaces: it needs root (or --nodes 1)")
    result = run(int(args.parameters), args.clients, args.shards, say=(lambda _: None) if args.json else print,
                 workdir=args.workdir, nodes=args.nodes)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":  # the Flower side, in Flower's environment (flower_system)
    import sys

    request = json.loads(sys.argv[1])
    print(json.dumps(flower_round([Path(f) for f in request["files"]], Path(request["model"]), request["samples"],
                                  request["limit_bytes"])))
