"""ServerApp: `lifl demo`'s job with Flower's own FedAvg (or, with ``lifl-gateway`` set, lifl's bridge
lifl.flower.LiflFedAvg aggregating in the lifl node there), evaluated on the test split every round.

A population of ``clients`` (lifl.workload's Dirichlet split, saved to the ``data`` file by
lifl.bench.flower) is served by a few SuperNodes. Every round the strategy draws ``goal`` clients
(those with at least two samples, as `lifl demo`'s workers do) and sends each one's message to
a SuperNode in turn, naming the client in the message's config (``partition-id``): a SuperNode
takes its messages one at a time and each becomes a ClientApp run for that client. Aggregation is FedAvg's own ``aggregate_train``
(weighted by ``num-examples``), or the bridge's: its grid pushes each reply to lifl as it is pulled. The round loop is Strategy.start's, without client-side
evaluation, and stops at the target accuracy or the deadline. Every round is written to the
``events`` file (JSON lines) for lifl.bench.flower to time: it runs in another process tree.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from lifl.flower import LiflFedAvg
from lifl.models import make_model
from lifl.workload import evaluate

torch.set_num_threads(1)  # like the clients: the machine's cores are shared by every process

app = ServerApp()


def sample_clients(eligible: list[int], goal: int, seed: int, server_round: int) -> list[int]:
    """The round's clients: ``goal`` distinct ones, reproducible from the seed and the round."""
    rng = np.random.default_rng([seed, server_round])
    return [int(c) for c in rng.choice(eligible, size=min(goal, len(eligible)), replace=False)]


def spread(clients: list[int], nodes: list[int]) -> list[tuple[int, int]]:
    """(client, node) pairs: the clients dealt to the SuperNodes in turn."""
    return [(client, nodes[i % len(nodes)]) for i, client in enumerate(clients)]


class Population:
    """Training messages for a client population larger than the set of SuperNodes serving it
    (mixed into FedAvg or the lifl bridge)."""

    eligible: list[int]
    goal: int
    seed: int
    min_nodes: int
    arrayrecord_key: str
    configrecord_key: str

    def __init__(self, eligible: list[int], goal: int, seed: int, min_nodes: int, **strategy: Any) -> None:
        super().__init__(fraction_evaluate=0.0, weighted_by_key="num-examples", **strategy)  # type: ignore[call-arg]
        self.eligible, self.goal, self.seed, self.min_nodes = eligible, goal, seed, min_nodes

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        while len(nodes := sorted(grid.get_node_ids())) < self.min_nodes:
            time.sleep(1.0)
        messages = []
        for client, node in spread(sample_clients(self.eligible, self.goal, self.seed, server_round), nodes):
            record = RecordDict({self.arrayrecord_key: arrays,
                                 self.configrecord_key: ConfigRecord({**config, "server-round": server_round, "partition-id": client})})
            messages.append(Message(record, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(server_round)))
        return messages


class PopulationFedAvg(Population, FedAvg):
    """Flower's FedAvg over the population."""


class PopulationLiflFedAvg(Population, LiflFedAvg):
    """The lifl bridge over the population."""


class Events:
    """Per-round events, appended as JSON lines (the process's own CPU time and peak RSS included)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1) if path else None

    def write(self, event: str, **fields: Any) -> None:
        if self.file is None:
            return
        times = os.times()
        self.file.write(json.dumps({"event": event, "t": time.time(), "cpu_s": times.user + times.system,
                                    "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **fields}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def client_means(replies: list[Message]) -> dict[str, float]:
    """Mean of each timing the ClientApps reported (seconds), over the round's good replies."""
    metrics = [next(iter(m.content.metric_records.values())) for m in replies if not m.has_error()]
    keys = ("startup-s", "data-s", "train-s")
    return {k.replace("-", "_"): round(float(np.mean([r[k] for r in metrics])), 3)
            for k in keys if metrics and all(k in r for r in metrics)}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    events = Events(str(cfg["events"]))
    try:
        events.write("start")
        seed, target, deadline = int(cfg["seed"]), float(cfg["target"]), float(cfg["deadline"])
        with np.load(str(cfg["data"])) as data:
            test = data["test_x"], data["test_y"]
            eligible = [c for c in range(int(cfg["clients"])) if len(data[f"y{c}"]) >= 2]
        population = eligible, int(cfg["goal"]), seed, int(cfg["min-nodes"])
        gateway = str(cfg["lifl-gateway"])
        strategy = PopulationLiflFedAvg(*population, gateway=gateway, poll_interval_s=float(cfg["poll-interval"])) \
            if gateway else PopulationFedAvg(*population)
        train_grid = strategy.streaming(grid) if isinstance(strategy, LiflFedAvg) else grid
        model = make_model("cnn", seed)
        arrays = ArrayRecord(model.state_dict())
        accuracy = evaluate(model, test)
        events.write("round", round=0, accuracy=accuracy)
        for server_round in range(1, int(cfg["max-rounds"]) + 1):
            if accuracy >= target or (deadline and time.time() >= deadline):
                break
            events.write("round_start", round=server_round)
            t = time.time()
            replies = list(train_grid.send_and_receive(strategy.configure_train(server_round, arrays, ConfigRecord(), grid),
                                                 timeout=max(1.0, deadline - time.time()) if deadline else None))
            t_replies = time.time()
            aggregated, _ = strategy.aggregate_train(server_round, replies)
            t_aggregated = time.time()
            if aggregated is not None:
                arrays = aggregated
                model.load_state_dict(arrays.to_torch_state_dict())
                accuracy = evaluate(model, test)
            events.write("round", round=server_round, accuracy=accuracy, replies=sum(not m.has_error() for m in replies),
                         failures=sum(m.has_error() for m in replies), send_receive_s=round(t_replies - t, 3),
                         aggregate_s=round(t_aggregated - t_replies, 4), clients=client_means(replies))
    except Exception as e:
        events.write("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        events.write("done")
        events.close()
