"""ClientApp: one local epoch of `lifl demo`'s training for the client a message names.

Flower's deployment engine runs a new ClientApp process for every message, so this module's
imports (torch, flwr) and loading the client's data (its partition of lifl.workload's split, from
the ``data`` file, as a device reads its own) are paid per message; the reply carries those
timings (``startup-s``: process start to the handler, ``data-s``, ``train-s``) beside
``num-examples``, FedAvg's weight.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lifl.models import make_model
from lifl.workload import train_local

torch.set_num_threads(1)

app = ClientApp()


def process_age() -> float:
    """Seconds since this process started (from /proc): the ClientApp's cold start so far."""
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


@app.train()
def train(msg: Message, context: Context) -> Message:
    startup = process_age()
    t_enter = time.time()
    cfg, run = msg.content["config"], context.run_config
    client, server_round, seed = int(cfg["partition-id"]), int(cfg["server-round"]), int(run["seed"])
    with np.load(str(run["data"])) as data:
        local = data[f"x{client}"], data[f"y{client}"]
    t_data = time.time()
    model = make_model("cnn", seed)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    samples = train_local(model, local, np.random.default_rng([seed, server_round, client]))
    t_trained = time.time()
    metrics = MetricRecord({"num-examples": samples, "startup-s": startup,
                            "data-s": t_data - t_enter, "train-s": t_trained - t_data})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)
