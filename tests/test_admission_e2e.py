"""Memory admission on a real node with a small --shm-limit: every upload is acknowledged (202)
or refused with 503 and Retry-After, never acknowledged and then dropped; every round is the
exact FedAvg of exactly its acknowledged updates; and a second job makes progress while the
first saturates the node's shared memory."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import OPERATOR_TOKEN, RunningNode, read_response, wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.ledger import JobSizes, round_extra
from lifl.quotas import Quota
from lifl.state import ClusterState

pytestmark = pytest.mark.slow
ELEMENTS = 8192  # float64: accumulators are as large as updates, so a round's accumulators fit in memory
GOAL = 20
LEAF_FAN_IN = 2
ROUNDS_OF_THE_SECOND_JOB = 3
UPLOAD_DEADLINE = 600.0  # s: bounds a failing run only (a correct one takes far less, even on a loaded machine)
KEEP_ALIVE_EVERY = 1.0  # s between the bytes a held upload sends to keep the gateway's minimum body rate
KEEP_ALIVE_BYTES = 2048  # per KEEP_ALIVE_EVERY: twice the gateway's default minimum (1 KiB/s)


def random_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"w": rng.standard_normal(ELEMENTS)}


UPDATE_BYTES = len(fmt.encode(random_model(np.random.default_rng(0))))
SIZES = JobSizes.of(fmt.parse_layout(fmt.encode(random_model(np.random.default_rng(0)))).spec(), LEAF_FAN_IN)
# What the k-th update of a round reserves (lifl.ledger), and the most a round must hold
# at once: its accumulators and model, and the inputs of the leaf taking its last update.
COSTS = [UPDATE_BYTES + round_extra(SIZES, k + 1, 0) - round_extra(SIZES, k, 0) for k in range(GOAL)]
ROUND_FLOOR = max(round_extra(SIZES, k + 1, 0) + (k % LEAF_FAN_IN + 1) * UPDATE_BYTES for k in range(GOAL))
ADMITTED_ALONE = 19  # the first job's round updates that exactly fill the memory left by the two models
CAPACITY = 2 * UPDATE_BYTES + sum(COSTS[:ADMITTED_ALONE])


@pytest.fixture
def start_node(node_with: Callable[..., RunningNode]) -> Callable[[int], RunningNode]:
    """Start a real node (agent, gateway, aggregators) with this much shared memory (one at a time)."""
    return lambda capacity: node_with(shm_capacity=capacity)


def create_job(node: RunningNode, job: str, model: dict[str, np.ndarray]) -> None:
    assert node.json("POST", "/v1/jobs", {"job": job, "goal": GOAL, "leaf_fan_in": LEAF_FAN_IN})[0] == 201
    assert node.json("PUT", f"/v1/jobs/{job}/model", fmt.encode(model))[0] == 201


def update_headers(client: str, samples: int, version: int) -> dict[str, str]:
    return {"X-Lifl-Client": client, "X-Lifl-Samples": str(samples), "X-Lifl-Base-Version": str(version)}


def refusal_code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


class Uploads:
    """Every upload's outcome, by job: (status, error code or "")."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[str, list[tuple[int, str]]] = {}

    def record(self, job: str, status: int, headers: dict[str, str], body: bytes) -> None:
        headers = {k.lower(): v for k, v in headers.items()}
        assert status in (202, 503), (job, status, body)  # acknowledged, or told to come back
        if status == 503:
            assert float(headers["retry-after"]) >= 1, headers
        with self.lock:
            self.outcomes.setdefault(job, []).append((status, refusal_code(body) if status == 503 else ""))

    def count(self, job: str) -> Counter:
        with self.lock:
            return Counter(code or "acknowledged" for _, code in self.outcomes.get(job, []))


def deliver(node: RunningNode, uploads: Uploads, job: str, client: str, blob: bytes, samples: int, version: int) -> None:
    """Push an update until it is acknowledged, waiting what each 503 says (a client's back-off)."""
    deadline = time.monotonic() + UPLOAD_DEADLINE
    while True:
        status, headers, body = node.request("POST", f"/v1/jobs/{job}/updates", blob, update_headers(client, samples, version))
        uploads.record(job, status, headers, body)
        if status == 202:
            return
        assert time.monotonic() < deadline, f"{job}: {client}'s update was refused for {UPLOAD_DEADLINE:g} s, last: {body!r}"
        time.sleep(float({k.lower(): v for k, v in headers.items()}["retry-after"]))


class HeldUpload:
    """An HTTP upload that sends its blob's header (the node admits or refuses it on that) and
    then holds the rest back, keeping to the gateway's minimum body rate, until ``finish``."""

    def __init__(self, node: RunningNode, job: str, client: str, blob: bytes, samples: int, version: int) -> None:
        host, port = node.http.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        head = (f"POST /v1/jobs/{job}/updates HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(blob)}\r\n"
                f"Authorization: Bearer {OPERATOR_TOKEN}\r\n")
        head += "".join(f"{k}: {v}\r\n" for k, v in update_headers(client, samples, version).items()) + "\r\n"
        self.blob, self.sent = blob, fmt.PREFIX_BYTES + fmt.header_length(blob[: fmt.PREFIX_BYTES]) + KEEP_ALIVE_BYTES
        self.sock.sendall(head.encode() + blob[: self.sent])

    def keep_alive(self) -> None:
        more = min(KEEP_ALIVE_BYTES, len(self.blob) - 1 - self.sent)  # never the last byte
        self.sock.sendall(self.blob[self.sent : self.sent + more])
        self.sent += more

    def finish(self) -> tuple[int, dict[str, str], bytes]:
        self.sock.sendall(self.blob[self.sent :])
        try:
            return read_response(self.sock)
        finally:
            self.sock.close()


@contextlib.contextmanager
def held_round(node: RunningNode, job: str, updates: list[tuple[dict[str, np.ndarray], int]]
               ) -> Iterator[tuple[list[HeldUpload], dict[str, Any]]]:
    """A round's updates sent at once, each holding its body back (kept to the gateway's minimum
    rate meanwhile): (the uploads, the round's state once the node admitted or refused each)."""
    held = [HeldUpload(node, job, f"c{i}", bytes(fmt.encode(u)), c, 0) for i, (u, c) in enumerate(updates)]
    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(KEEP_ALIVE_EVERY):
            for h in held:
                h.keep_alive()

    def decided() -> dict[str, Any] | None:
        # the round's counts pass through states where an upload holds a slot that the node is
        # about to refuse; the node's own count of what it admitted tells them apart
        r = node.json("GET", f"/v1/jobs/{job}")[1]["round"]
        return r if r["in_progress"] + sum(r["rejected"].values()) == len(updates) and \
            r["in_progress"] == queue_length(node, job) else None

    pacer = threading.Thread(target=keep_alive, daemon=True)
    pacer.start()
    try:
        yield held, wait_for(decided, what=f"every held upload of {job} admitted or refused")
    finally:
        stop.set()
        pacer.join()


def fedavg(updates: list[tuple[dict[str, np.ndarray], int]]) -> np.ndarray:
    return sum(u["w"] * c for u, c in updates) / sum(c for _, c in updates)


def queue_length(node: RunningNode, job: str) -> int:
    """The updates the node has admitted for ``job`` and not aggregated yet (its metric)."""
    text = node.request("GET", "/metrics")[2].decode()
    found = re.search(rf'^lifl_queue_length{{job="{job}"}} (\S+)$', text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def version_of(node: RunningNode, job: str) -> int:
    return node.json("GET", f"/v1/jobs/{job}")[1]["version"]


def check_round(node: RunningNode, job: str, version: int, updates: list[tuple[dict[str, np.ndarray], int]]) -> None:
    """The round on ``version`` completed as the FedAvg of exactly ``updates``, its acknowledged ones."""
    wait_for(lambda: version_of(node, job) > version, what=f"{job} version {version + 1}")
    status, headers, body = node.request("GET", f"/v1/jobs/{job}/model")
    assert status == 200 and headers["X-Lifl-Version"] == str(version + 1)  # no further round: its clients wait for us
    model = fmt.views(body, kernels.validate(body))["w"]
    np.testing.assert_allclose(model, fedavg(updates), rtol=1e-12, atol=1e-12)


def run_rounds(node: RunningNode, uploads: Uploads, job: str, rng: np.random.Generator, first: int,
               more: Callable[[int], bool], pending: list[tuple[dict[str, np.ndarray], int]] | None = None) -> int:
    """Rounds of ``GOAL`` clients pushing at once, from version ``first`` while ``more(rounds done)``;
    ``pending``: the first round's updates (one was refused already)."""
    version = first
    while more(version - first):
        updates = pending or [(random_model(rng), int(rng.integers(1, 100))) for _ in range(GOAL)]
        pending = None
        with ThreadPoolExecutor(GOAL) as pool:
            for done in [pool.submit(deliver, node, uploads, job, f"c{i}", bytes(fmt.encode(u)), c, version)
                         for i, (u, c) in enumerate(updates)]:
                done.result()
        check_round(node, job, version, updates)
        version += 1
    return version - first


def test_a_saturating_job_is_refused_with_503_and_a_second_job_still_completes_rounds(
        start_node: Callable[[int], RunningNode]) -> None:
    # a round fits in half the memory left by the two jobs' models, even while a third is installed
    assert (CAPACITY - 3 * UPDATE_BYTES) // 2 >= ROUND_FLOOR
    node = start_node(CAPACITY)
    rng = np.random.default_rng(7)
    create_job(node, "busy", random_model(rng))
    create_job(node, "other", random_model(rng))
    uploads = Uploads()

    # the busy job alone: all its clients send at once and hold their bodies; memory is exactly
    # full after ADMITTED_ALONE admissions, and the rest are refused
    busy = [(random_model(rng), int(rng.integers(1, 100))) for _ in range(GOAL)]
    with held_round(node, "busy", busy) as (held, round_state):
        assert (round_state["in_progress"], round_state["rejected"]) == (ADMITTED_ALONE, {"shm_exhausted": GOAL - ADMITTED_ALONE})
        # the other job now finds no free memory: told to retry, and counted as wanting memory
        first = (random_model(rng), int(rng.integers(1, 100)))
        status, headers, body = node.request("POST", "/v1/jobs/other/updates", bytes(fmt.encode(first[0])),
                                             update_headers("c0", first[1], 0))
        uploads.record("other", status, headers, body)
        assert (status, refusal_code(body)) == (503, "shm_exhausted")
    outcomes = [h.finish() for h in held]
    for status, headers, body in outcomes:
        uploads.record("busy", status, headers, body)
    assert Counter(s for s, _, _ in outcomes) == {202: ADMITTED_ALONE, 503: GOAL - ADMITTED_ALONE}
    refused_first = [i for i, (s, _, _) in enumerate(outcomes) if s == 503]  # they push again

    # both jobs run rounds at once: the other job's clients all push concurrently; the busy job
    # keeps going, saturating its share, until the other has completed its rounds
    other_done = threading.Event()
    with ThreadPoolExecutor(2) as jobs:
        def busy_rounds() -> int:
            with ThreadPoolExecutor(len(refused_first)) as pool:
                for done in [pool.submit(deliver, node, uploads, "busy", f"c{i}", bytes(fmt.encode(busy[i][0])), busy[i][1], 0)
                             for i in refused_first]:
                    done.result()
            check_round(node, "busy", 0, busy)
            return 1 + run_rounds(node, uploads, "busy", np.random.default_rng(1), 1, lambda _: not other_done.is_set())

        def other_rounds() -> int:
            try:
                other_rng = np.random.default_rng(2)  # numpy generators are not shared between threads
                pending = [first] + [(random_model(other_rng), int(other_rng.integers(1, 100))) for _ in range(GOAL - 1)]
                return run_rounds(node, uploads, "other", other_rng, 0, lambda n: n < ROUNDS_OF_THE_SECOND_JOB, pending)
            finally:
                other_done.set()

        busy_future, other_future = jobs.submit(busy_rounds), jobs.submit(other_rounds)
        rounds = {"other": other_future.result(), "busy": busy_future.result()}

    assert rounds["other"] == ROUNDS_OF_THE_SECOND_JOB and rounds["busy"] >= 1
    for job in ("busy", "other"):
        history = node.json("GET", f"/v1/jobs/{job}/rounds")[1]["rounds"]
        assert [(r["outcome"], r["updates"], r["lost"]) for r in history] == [("complete", GOAL, {})] * rounds[job]
        assert [r["new_version"] for r in history] == list(range(1, rounds[job] + 1))
        assert uploads.count(job)["acknowledged"] == GOAL * rounds[job]  # every acknowledged update is in a round
    _, _, metrics = node.request("GET", "/metrics")
    text = metrics.decode()
    assert 'lifl_admission_refusals_total{job="busy",reason="shm_exhausted"}' in text
    assert 'lifl_job_shm_bytes{job="busy",state="reserved"}' in text
    assert 'outcome="abandoned"' not in text
    # the node's status leaves out a job with nothing going on, so its accounting is read from the metrics
    busy_memory = {sample.labels["state"]: sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "lifl_job_shm_bytes" and sample.labels["job"] == "busy"}
    assert busy_memory.keys() == {"working", "reserved"} and min(busy_memory.values()) >= 0
    print(f"\nadmission under saturation: capacity {CAPACITY} bytes, updates of {UPDATE_BYTES} bytes, goal {GOAL}, "
          f"rounds {rounds}, uploads {({job: dict(uploads.count(job)) for job in ('busy', 'other')})}, lost 0")


@pytest.mark.parametrize("spare", [0, -1])
def test_a_round_that_exactly_fits_completes_and_with_one_byte_less_its_model_is_refused(
        start_node: Callable[[int], RunningNode], spare: int) -> None:
    """A round of one update needs the update and the next model next to the current model; a
    job whose round can never fit is refused when its model is set, before any update of it is
    acknowledged (a 422 that says how much it needs and how much there is)."""
    node = start_node(UPDATE_BYTES + COSTS[0] + spare)
    rng = np.random.default_rng(spare + 1)
    assert node.json("POST", "/v1/jobs", {"job": "j", "goal": 1, "leaf_fan_in": LEAF_FAN_IN})[0] == 201
    status, answer = node.json("PUT", "/v1/jobs/j/model", fmt.encode(random_model(rng)))
    if spare == 0:
        assert status == 201
        update = random_model(rng)
        assert node.request("POST", "/v1/jobs/j/updates", bytes(fmt.encode(update)), update_headers("c0", 1, 0))[0] == 202
        check_round(node, "j", 0, [(update, 1)])
        return
    error = answer["error"]
    assert status == 422 and error["code"] == "round_too_large", answer
    assert (error["needed"], error["available"]) == (COSTS[0], COSTS[0] - 1)
    assert f"it needs {COSTS[0]} bytes of shared memory at once on a node (1 updates of {UPDATE_BYTES} bytes" in error["message"]
    job = node.json("GET", "/v1/jobs/j")[1]
    assert job["version"] is None or job["version"] < 0, job  # no model: nothing may be acknowledged
    assert node.push("j", bytes(fmt.encode(random_model(rng))))[0] == 409


def test_a_job_whose_round_could_never_fit_is_refused_at_its_model_not_after_an_acknowledgement(
        start_node: Callable[[int], RunningNode]) -> None:
    """The probe's case: a round needing more than the node has for jobs used to take its first
    update (202) and then refuse the rest with shm_too_small forever."""
    node = start_node(UPDATE_BYTES + ROUND_FLOOR - 1)
    create = {"job": "big", "goal": GOAL, "leaf_fan_in": LEAF_FAN_IN}
    assert node.json("POST", "/v1/jobs", create)[0] == 201
    status, answer = node.json("PUT", "/v1/jobs/big/model", fmt.encode(random_model(np.random.default_rng(3))))
    assert status == 422 and (answer["error"]["needed"], answer["error"]["available"]) == (ROUND_FLOOR, ROUND_FLOOR - 1)
    assert node.json("POST", "/v1/jobs", {**create, "job": "smaller", "goal": GOAL - 2})[0] == 201
    assert node.json("PUT", "/v1/jobs/smaller/model", fmt.encode(random_model(np.random.default_rng(3))))[0] == 201



def test_a_round_that_cannot_fit_in_its_tenants_shm_bytes_quota_is_refused_at_its_model(
        start_node: Callable[[int], RunningNode], redis_url: str) -> None:
    ClusterState(redis_url).set_quota("tight", Quota(shm_bytes=UPDATE_BYTES + ROUND_FLOOR - 1))  # read as the agent starts
    node = start_node(4 * CAPACITY)  # the node has room: only the quota is short by a byte
    assert node.json("POST", "/v1/jobs", {"job": "tight", "goal": GOAL, "leaf_fan_in": LEAF_FAN_IN, "tenant": "tight"})[0] == 201
    status, answer = node.json("PUT", "/v1/jobs/tight/model", fmt.encode(random_model(np.random.default_rng(4))))
    assert status == 422 and (answer["error"]["needed"], answer["error"]["available"]) == (ROUND_FLOOR, ROUND_FLOOR - 1)
    assert "shm_bytes quota" in answer["error"]["message"]
