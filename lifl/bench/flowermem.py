"""`lifl bench flower-memory`: the Flower server's peak memory aggregating a round of replies with
Flower's FedAvg against the lifl bridge (lifl.flower.LiflFedAvg).

Each side runs in a fresh process of Flower's environment (lifl.bench.flower.flower_env) that
aggregates one round of ``replies`` synthetic replies of a model's shapes (ResNet-18: 11.7M
parameters, made with numpy, nothing downloaded) coming from an in-process grid
(``SyntheticGrid``: each reply is made when it is pulled, as the ServerApp inflates a reply it
pulls from the SuperLink):

- fedavg: Flower's ``Grid.send_and_receive`` loop collects every reply, then ``FedAvg.aggregate_train``
  (all replies held, plus its weighted copies);
- bridge: ``LiflFedAvg.streaming(grid)`` pushes each reply to a lifl node as it is pulled and
  drops its arrays, then ``aggregate_train`` fetches lifl's aggregate.

The figure is the process's peak RSS while the round is aggregated minus its RSS just before (the
global model and the libraries are there already): the peak is reset there (/proc/self/clear_refs)
and read from VmHWM. The bridge's memory moves to the lifl node, so its shared memory (the
``lifl_shm_bytes`` gauge, sampled while the round runs) is reported beside it, separately.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

MB = 1 << 20
SAMPLE_INTERVAL_S = 0.05


# -- models -------------------------------------------------------------------------------------------


def resnet18_shapes(classes: int = 1000) -> dict[str, tuple[int, ...]]:
    """torchvision's ResNet-18 state_dict: names and shapes (11,689,512 parameters; 11,699,112 floats with
    BatchNorm's running statistics)."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, 3, 7, 7)}

    def bn(prefix: str, n: int) -> None:
        shapes.update({f"{prefix}.{k}": (n,) for k in ("weight", "bias", "running_mean", "running_var")})
        shapes[f"{prefix}.num_batches_tracked"] = ()

    bn("bn1", 64)
    c_in = 64
    for layer, (c_out, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        for block in range(2):
            p = f"layer{layer}.{block}"
            shapes[f"{p}.conv1.weight"] = (c_out, c_in, 3, 3)
            bn(f"{p}.bn1", c_out)
            shapes[f"{p}.conv2.weight"] = (c_out, c_out, 3, 3)
            bn(f"{p}.bn2", c_out)
            if block == 0 and (stride != 1 or c_in != c_out):
                shapes[f"{p}.downsample.0.weight"] = (c_out, c_in, 1, 1)
                bn(f"{p}.downsample.1", c_out)
            c_in = c_out
    shapes["fc.weight"], shapes["fc.bias"] = (classes, 512), (classes,)
    return shapes


MODELS: dict[str, Callable[[], dict[str, tuple[int, ...]]]] = {
    "resnet18": resnet18_shapes,
    "tiny": lambda: {"conv.weight": (8, 1, 3, 3), "bn.num_batches_tracked": (), "fc.weight": (10, 32), "fc.bias": (10,)},
}


def synthetic_arrays(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Arrays of these shapes: float32 normals, and int64 counters for BatchNorm's batch counts."""
    rng = np.random.default_rng(seed)
    return {k: np.array(7 + seed, np.int64) if k.endswith("num_batches_tracked")
            else rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


def parameter_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) for k, s in shapes.items() if not k.endswith("num_batches_tracked"))


# -- memory of this process -------------------------------------------------------------------------


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> float:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0), and return that RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


# -- the measured process (Flower's environment) ----------------------------------------------------------


def in_process_grid(nodes: int, exchange: Callable[[list[tuple[int, Any]]], list[Any]]) -> Any:
    """An in-process Flower Grid of nodes 1..``nodes``: the messages pulled are handed to
    ``exchange`` with their positions in push order, which returns their replies (a node that drops
    out gives none). ``send_and_receive`` holds every reply, as Flower's grids do, and with a
    ``timeout`` waits it out when a reply is missing (Flower's grids poll until then)."""
    from flwr.app import Message
    from flwr.serverapp import Grid
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # what a ServerApp process is given

    class InProcessGrid(Grid):
        def __init__(self) -> None:
            self.sent: dict[str, tuple[int, Message]] = {}  # pushed, not yet pulled
            self.pushed = 0
            self._run: Any = SimpleNamespace(run_id=1)

        def set_run(self, run: Any) -> None:
            self._run = run

        @property
        def run(self) -> Any:
            return self._run

        def create_message(self, content: Any, message_type: str, dst_node_id: int, group_id: str,
                           ttl: float | None = None) -> Message:
            return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

        def get_node_ids(self) -> Iterable[int]:
            return list(range(1, nodes + 1))

        def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
            ids = []
            for message in messages:
                message_id = f"{self.pushed:064x}"
                message.metadata.__dict__["_message_id"] = message_id  # as the SuperLink's grid sets it
                self.sent[message_id] = (self.pushed, message)
                self.pushed += 1
                ids.append(message_id)
            return ids

        def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
            return exchange([self.sent.pop(message_id) for message_id in message_ids])

        def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
            t = time.monotonic()
            ids = list(self.push_messages(messages))
            replies = list(self.pull_messages(ids))
            if timeout is not None and len(replies) < len(ids):
                time.sleep(max(0.0, timeout - (time.monotonic() - t)))
            return replies

    return InProcessGrid()


def synthetic_grid(shapes: dict[str, tuple[int, ...]], nodes: int, fail: Iterable[int] = (),
                   answer: Callable[[int, Any], Any] | None = None) -> Any:
    """An in-process grid (``in_process_grid``) whose nodes answer a training message with arrays
    of ``shapes`` seeded by the message's position (so both strategies see the same replies) and
    ``num-examples`` 10 + position, made when the reply is pulled; the messages at positions in
    ``fail`` get an error reply instead. ``answer(position, message)``, when given, makes the
    reply's RecordDict instead (a client that trains)."""
    from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict

    failing = set(fail)

    def reply(position: int, message: Message) -> Message:
        if position in failing:
            return Message(Error(code=0, reason="a synthetic failure"), reply_to=message)
        if answer is not None:
            return Message(answer(position, message), reply_to=message)
        arrays = ArrayRecord({k: Array(v) for k, v in synthetic_arrays(shapes, position).items()})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10 + position})}),
                       reply_to=message)

    return in_process_grid(nodes, lambda pulled: [reply(position, message) for position, message in pulled])


def measure(strategy: str, model: str, replies: int) -> dict[str, Any]:
    """One round of ``replies`` replies aggregated by ``strategy`` ("fedavg" or "bridge") in this process."""
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    shapes = MODELS[model]()
    grid = synthetic_grid(shapes, replies)
    kwargs = {"fraction_train": 1.0, "min_train_nodes": replies, "min_available_nodes": replies, "fraction_evaluate": 0.0}
    if strategy == "bridge":
        from lifl.flower import LiflFedAvg

        bridge = LiflFedAvg(os.environ["LIFL_GATEWAY"], poll_interval_s=0.0, **kwargs)
        fedavg, train_grid = bridge, bridge.streaming(grid)
    else:
        fedavg, train_grid = FedAvg(**kwargs), grid
    arrays = ArrayRecord({k: Array(v) for k, v in synthetic_arrays(shapes, 10_000).items()})
    messages = list(fedavg.configure_train(1, arrays, ConfigRecord(), grid))
    baseline = reset_peak()
    t = time.perf_counter()
    aggregated, _ = fedavg.aggregate_train(1, train_grid.send_and_receive(messages, timeout=None))
    seconds = time.perf_counter() - t
    peak = _status_mb("VmHWM")
    assert aggregated is not None and list(aggregated) == list(shapes), "the round produced no model"
    first = aggregated["fc.bias"].numpy()
    return {"strategy": strategy, "baseline_rss_mb": round(baseline, 1), "peak_rss_mb": round(peak, 1),
            "peak_above_baseline_mb": round(peak - baseline, 1), "aggregate_s": round(seconds, 3),
            "fc_bias_head": [round(float(v), 5) for v in first.astype(np.float64).ravel()[:3]]}


# -- the bench (lifl's environment) ---------------------------------------------------------------------


def _shm_gauges(gateway: Any) -> dict[str, float]:
    out = {}
    for line in gateway.metrics().splitlines():
        if line.startswith("lifl_shm_bytes{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


def _measured(python: Path, strategy: str, model: str, replies: int, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([str(python), "-m", "lifl.bench.flowermem", "--child", strategy, "--model", model,
                           "--replies", str(replies)], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"measuring {strategy} failed ({done.returncode}):\n{done.stdout}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(model: str = "resnet18", replies: int = 20, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from lifl.bench.flower import flower_env
    from lifl.client import Gateway
    from lifl.node.supervisor import Node, NodeConfig

    python = flower_env() / "python"
    shapes = MODELS[model]()
    out: dict[str, Any] = {"model": model, "parameters": parameter_count(shapes), "replies": replies,
                           "model_mb": round(sum(synthetic_arrays(shapes, 0)[k].nbytes for k in shapes) / MB, 1)}
    say(f"{model}: {out['parameters']:,} parameters ({out['model_mb']} MB), {replies} replies")
    out["flower_fedavg"] = _measured(python, "fedavg", model, replies, dict(os.environ))
    say(f"Flower FedAvg: {out['flower_fedavg']['peak_above_baseline_mb']} MB above baseline")
    with tempfile.TemporaryDirectory(prefix="lifl-flowermem-") as tmp, open(Path(tmp) / "node.log", "w") as log:
        os.chmod(tmp, 0o755)  # the node's redis and gateway run as its service user
        name = f"fm{os.getpid() % 100000}"
        node = Node(NodeConfig(node=name, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=Path(tmp) / "run",
                               data_dir=Path(tmp) / "data", shm_capacity=8 << 30), log=log)
        http = node.start().http
        gateway = Gateway(http, token=node.operator_token)
        peaks: dict[str, float] = {}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                for state, value in _shm_gauges(gateway).items():
                    peaks[state] = max(peaks.get(state, 0.0), value)
                stop.wait(SAMPLE_INTERVAL_S)

        try:
            before = _shm_gauges(gateway)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            env = {**os.environ, "LIFL_GATEWAY": http, "LIFL_TOKEN": node.operator_token}
            try:
                out["lifl_bridge"] = _measured(python, "bridge", model, replies, env)
            finally:
                stop.set()
                sampler.join()
            out["lifl_node_shm"] = {f"{state}_peak_mb": round(v / MB, 1) for state, v in sorted(peaks.items())}
            out["lifl_node_shm"]["used_before_mb"] = round(before.get("used", 0.0) / MB, 1)
        finally:
            gateway.close()
            node.stop()
    say(f"lifl bridge: {out['lifl_bridge']['peak_above_baseline_mb']} MB above baseline; "
        f"lifl node shared memory: {out['lifl_node_shm']}")
    out["saved_mb"] = round(out["flower_fedavg"]["peak_above_baseline_mb"] - out["lifl_bridge"]["peak_above_baseline_mb"], 1)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replies", type=int, default=20, help="replies in the round (default 20)")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet18", help="the replies' shapes (default resnet18)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.replies < 1:
        raise SystemExit("--replies must be at least 1")
    result = run(args.model, args.replies, say=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"server peak above baseline: Flower FedAvg {result['flower_fedavg']['peak_above_baseline_mb']} MB, "
              f"lifl bridge {result['lifl_bridge']['peak_above_baseline_mb']} MB (saved {result['saved_mb']} MB)")
    return 0


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m lifl.bench.flowermem")
    p.add_argument("--child", choices=("fedavg", "bridge"), required=True)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--replies", type=int, required=True)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.child, args.model, args.replies)))


if __name__ == "__main__":
    _child(sys.argv[1:])
