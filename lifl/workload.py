"""The FL workload of `lifl demo` (the LIFL paper's §6.2, offline: nothing is downloaded).

- Data: scikit-learn's bundled digits (1,797 8x8 images, 10 classes); a stratified 20 %
  test split; the rest split into non-IID clients by Dirichlet label skew (``alpha``).
- Models: a small CNN with batch normalisation (the default), or torchvision's ResNet-18/34/152
  built with ``weights=None`` for system-scale runs where accuracy is not the point.
- Clients: SGD with learning rate 0.01, batch 32, one local epoch. A fixed number of client
  slots is active at a time; each slot picks a client of the population, lets it hibernate a
  random interval (the paper's [0, 60] s, scaled), then runs one round through the gateway.

Worker processes (``python -m lifl.workload``) each run some of the slots and talk to the
gateway over the network, as real clients do. Every process derives the same split from the
seed, so no data is shipped around.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from lifl.models import MODELS, make_model

LR, BATCH, EPOCHS = 0.01, 32, 1


@dataclass
class Digits:
    clients: list[tuple[np.ndarray, np.ndarray]]  # (images N x 1 x 8 x 8 float32, labels int64) per client
    test: tuple[np.ndarray, np.ndarray]


def dirichlet_split(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices per client: for every class, shares drawn from Dirichlet(alpha)."""
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        ids = np.flatnonzero(labels == c)
        rng.shuffle(ids)
        cuts = (np.cumsum(rng.dirichlet([alpha] * n_clients)) * len(ids)).astype(int)[:-1]
        for i, chunk in enumerate(np.split(ids, cuts)):
            parts[i].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def load_digits_split(n_clients: int, alpha: float, seed: int) -> Digits:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    parts = dirichlet_split(y_train, n_clients, alpha, np.random.default_rng(seed))
    return Digits([(x_train[p], y_train[p].astype(np.int64)) for p in parts], (x_test, y_test.astype(np.int64)))


def train_local(model: Any, data: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> int:
    """One local epoch of SGD (lr 0.01, batch 32); returns the number of samples seen."""
    import torch
    from torch import nn

    x, y = data
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for _ in range(EPOCHS):
        order = rng.permutation(len(x))
        for start in range(0, len(x), BATCH):
            batch = order[start : start + BATCH]
            if len(batch) < 2:  # batch norm needs two samples to train on
                continue
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.from_numpy(x[batch])), torch.from_numpy(y[batch])).backward()
            optimizer.step()
    return len(x)


def evaluate(model: Any, data: tuple[np.ndarray, np.ndarray]) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(data[0])).argmax(1).numpy()
    return float((predictions == data[1]).mean())


# -- client worker processes -----------------------------------------------------------------------


def worker_shares(clients: int, active: int, workers: int) -> list[tuple[int, int, int]]:
    """(first client, clients, active slots) of each worker process: the population and the
    active slots split evenly among at most ``active`` workers."""
    n = max(1, min(workers, active))
    return [(clients * w // n, clients * (w + 1) // n - clients * w // n, active // n + (1 if w < active % n else 0))
            for w in range(n)]


def wait_ready(workers: list[Any]) -> None:
    """Wait for every worker process's "clients ready" line (lines a library printed while
    loading come first)."""
    for proc in workers:
        while (line := proc.stdout.readline()) and line.strip() != "clients ready":
            pass
        if not line:
            raise RuntimeError(f"a client worker did not start (exit status {proc.wait()})")


def slot_clients(slot: int, args: argparse.Namespace, digits: Digits, taken: set[int], lock: threading.Lock,
                 stop: threading.Event) -> Iterator[tuple[int, np.random.Generator]]:
    """The clients one active slot plays in turn, with the slot's random generator: a free
    client of the worker's share, after it hibernated; it is given back once the caller is
    done with it (its turn runs inside ``client_turn``)."""
    rng = np.random.default_rng([args.seed, args.worker, slot])
    while not stop.is_set():
        with lock:
            free = [c for c in range(args.first_client, args.first_client + args.n_clients)
                    if c not in taken and len(digits.clients[c][0]) >= 2]
            if not free:
                return
            client = int(rng.choice(free))
            taken.add(client)
        try:
            if stop.wait(rng.uniform(0, args.hibernate)):
                return
            yield client, rng
        finally:
            with lock:
                taken.discard(client)


@contextmanager
def client_turn(client: int, stop: threading.Event) -> Iterator[None]:
    """A client failing is part of FL: report it and let the slot go on."""
    try:
        yield
    except Exception as e:
        print(f"lifl client-{client}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        stop.wait(0.5)


def run_slot(slot: int, args: argparse.Namespace, digits: Digits, tokens: dict[str, str], taken: set[int], lock: threading.Lock,
             stop: threading.Event) -> None:
    """One active client slot: pick a client, hibernate, take part in a round, repeat."""
    from lifl.client import Participant

    model = make_model(args.model)
    address, protocol = (args.grpc, "grpc") if (args.protocol == "grpc" or args.protocol == "mixed" and slot % 2) else (args.http, "http")
    for client, rng in slot_clients(slot, args, digits, taken, lock, stop):
        with client_turn(client, stop):
            participant = Participant(address, args.job, protocol=protocol, as_torch=True, token=tokens[f"client-{client}"])

            def train(state: dict[str, Any], version: int) -> tuple[dict[str, Any], int]:
                model.load_state_dict(state)
                samples = train_local(model, digits.clients[client], rng)
                return model.state_dict(), samples

            try:
                while not stop.is_set():
                    result = participant.run_round(train)
                    if result.outcome == "accepted":
                        break
                    if result.outcome == "no_slot":  # the round is full: wait for the next one
                        participant.wait_for_version(result.version, timeout=2.0)
            finally:
                participant.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-clients", description="simulated FL clients (started by `lifl demo`)")
    p.add_argument("--http", required=True)
    p.add_argument("--grpc", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--model", default="cnn", choices=MODELS)
    p.add_argument("--clients", type=int, required=True, help="population size")
    p.add_argument("--first-client", type=int, required=True, help="this worker's share of the population")
    p.add_argument("--n-clients", type=int, required=True)
    p.add_argument("--slots", type=int, required=True, help="clients of this worker active at a time")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--hibernate", type=float, default=1.0, help="seconds, the most a client rests between rounds")
    p.add_argument("--protocol", choices=("http", "grpc", "mixed"), default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--tokens", type=Path, required=True, help="JSON file: each client's token, by client name")
    args = p.parse_args(argv)
    tokens = json.loads(args.tokens.read_text())
    import torch

    torch.set_num_threads(1)
    from lifl.procs import die_with_parent, on_signals

    die_with_parent()
    digits = load_digits_split(args.clients, args.alpha, args.seed)
    stop = threading.Event()
    on_signals(stop.set)
    taken: set[int] = set()
    lock = threading.Lock()
    threads = [threading.Thread(target=run_slot, args=(i, args, digits, tokens, taken, lock, stop), daemon=True) for i in range(args.slots)]
    for t in threads:
        t.start()
    print("clients ready", flush=True)
    while not stop.wait(0.5):
        pass
    for t in threads:
        t.join(timeout=5)


if __name__ == "__main__":
    main()
