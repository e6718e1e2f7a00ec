"""One FL round through a gateway, checked against FedAvg in float64: run inside the test bed,
where the node pod's gateway is (``scripts/k8s-testenv.sh exec python tests/k8s/fedavg_round.py
HOST:PORT TENANT JOB UPDATES``, the operator's token in $LIFL_OPERATOR_TOKEN). Prints one JSON
object: the version reached and the largest error against the reference."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from lifl import format as fmt
from lifl.client import Gateway

SHAPES = {"conv.weight": (16, 1, 3, 3), "conv.bias": (16,), "fc.weight": (10, 256), "fc.bias": (10,)}
ROUND_TIMEOUT_S = 300.0  # bounds a failure only


def main(address: str, tenant: str, job: str, count: int) -> dict[str, float | int]:
    operator = Gateway(address, token=os.environ["LIFL_OPERATOR_TOKEN"])
    gateway = Gateway(address, token=operator.create_token("tenant", tenant, ttl_s=3600)["token"])
    rng = np.random.default_rng(11)
    gateway.create_job(job, count, leaf_fan_in=2)
    gateway.set_model(job, fmt.encode({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}))
    updates = [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(count)]
    samples = [int(s) for s in rng.integers(1, 100, count)]
    for i, (update, weight) in enumerate(zip(updates, samples)):
        client = Gateway(address, token=gateway.create_token("client", tenant, job=job, client=f"c{i}", ttl_s=3600)["token"])
        client.push(job, fmt.encode(update), samples=weight, base_version=0)
        client.close()
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while (gateway.job(job)["version"] or 0) < 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"round 1 of {job} did not finish in {ROUND_TIMEOUT_S:.0f} s: {gateway.job(job)}")
        time.sleep(0.1)
    version, blob = gateway.model(job)
    model = fmt.views(blob, fmt.parse_layout(blob))
    error = 0.0
    for name in SHAPES:
        reference = sum(u[name].astype(np.float64) * w for u, w in zip(updates, samples)) / sum(samples)
        error = max(error, float(np.max(np.abs(model[name].astype(np.float64) - reference))))
    return {"version": version, "max_abs_error": error, "updates": count}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
