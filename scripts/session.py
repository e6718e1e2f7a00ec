"""`make demo`: start a lifl node with `lifl up`, aggregate one round over HTTP and gRPC, check it.

Eight clients each send an update of a small CNN's weights (0.8 MB of float32), half
over HTTP and half over gRPC; the node aggregates them eagerly through its leaf, middle and top
aggregators into version 1, which is checked against a float64 FedAvg reference. The node is
then stopped with Ctrl-C's signal and /dev/shm is checked to be clean.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from lifl import format as fmt
from lifl.client import Gateway

SHAPES = {"conv1.weight": (64, 3, 7, 7), "conv2.weight": (128, 64, 3, 3), "fc.weight": (10, 100352 // 8), "fc.bias": (10,)}
CLIENTS = 8


def main() -> int:
    state = tempfile.mkdtemp(prefix="lifl-demo-")  # a fresh node: its redis keeps jobs across restarts
    print("$ lifl up --http 127.0.0.1:0 --grpc 127.0.0.1:0", flush=True)
    up = subprocess.Popen([sys.executable, "-m", "lifl", "up", "--node", "demo", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
                           "--data-dir", state], stdout=subprocess.PIPE, text=True)
    lines = []
    while not any(line.startswith("  grpc:") for line in lines):
        line = up.stdout.readline()
        if not line:
            print("".join(lines))
            return 1
        lines.append(line)
        print("  " + line, end="")
    threading.Thread(target=lambda: [print("  " + l, end="") for l in up.stdout], daemon=True).start()
    http = next(l for l in lines if l.startswith("  http:")).split()[1]
    grpc = next(l for l in lines if l.startswith("  grpc:")).split()[1]
    try:
        return session(http, grpc)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
        shutil.rmtree(state, ignore_errors=True)
        left = list(Path("/dev/shm").glob("lifl-demo-*"))
        print(f"\nnode stopped; lifl objects left in /dev/shm: {len(left)}")


def session(http: str, grpc: str) -> int:
    rng = np.random.default_rng(0)
    model = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}
    blob = fmt.encode(model)
    h, g = Gateway(http), Gateway(grpc, protocol="grpc")
    print(f"\ncreate job 'demo' (goal {CLIENTS} updates per round) and set its model ({len(blob) / 1e6:.1f} MB)")
    h.create_job("demo", CLIENTS)
    h.set_model("demo", blob)

    updates = [{k: v + (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for k, v in model.items()} for _ in range(CLIENTS)]
    samples = [int(s) for s in rng.integers(20, 200, CLIENTS)]
    t0 = time.perf_counter()
    for i, (u, n) in enumerate(zip(updates, samples)):
        gateway, protocol = (h, "HTTP") if i % 2 == 0 else (g, "gRPC")
        reply = gateway.push("demo", fmt.encode(u), client=f"client-{i}", samples=n, base_version=0)
        print(f"  client-{i} pushed {n:3d} samples over {protocol}: key {reply['key'][:12]}...")
    while h.job("demo")["version"] != 1:
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    version, data = h.model("demo")
    got = fmt.views(data, fmt.validate(data))
    worst = 0.0
    for name in SHAPES:
        ref = sum(u[name].astype(np.float64) * n for u, n in zip(updates, samples)) / sum(samples)
        worst = max(worst, float(np.max(np.abs(got[name] - ref) / (np.abs(ref) + 1e-3))))
    status = h.job("demo")
    last = status["last_round"]
    print(f"\nversion {version} installed {elapsed * 1e3:.0f} ms after the first update "
          f"(round: {last['updates']} updates, {last['samples']} samples, {last['seconds'] * 1e3:.0f} ms)")
    print(f"largest error against a float64 FedAvg reference: {worst:.2e} (relative, tolerance 1e-5)")
    _, _, metrics = h._request("GET", "/metrics")
    for line in metrics.decode().splitlines():
        if line.startswith(("lifl_update_arrivals_total", "lifl_aggregator_starts_total", "lifl_node_rounds_total")):
            print("  " + line)
    h.close()
    g.close()
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
