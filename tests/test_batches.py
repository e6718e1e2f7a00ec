"""The agent's batched hot path at its limits: what arrives while a job's Redis call is in flight
goes in its next call, up to ``MAX_BATCH`` a call; a batch of one costs one call; a batch whose
answer is lost (the connection to Redis breaks after the script ran) is sent again and counts
every update exactly once, with no acknowledged update lost. A real agent and real aggregator
processes, behind a proxy in front of the real redis-server (tests/redis_proxy.py)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl.jobs import JobSpec
from lifl.node.agent import MAX_BATCH, Agent, AgentConfig
from lifl.protocol import PROTOCOL, Admit, GetMetrics, Hello
from lifl.rpc import encode_frame
from lifl.state import ClusterState
from redis_proxy import RedisProxy
from test_agent import gateway, metric, push, put_model, random_model, read_model

pytestmark = pytest.mark.slow

# The agent's Redis calls wait this long, not the default 1.5 s: a call is held on purpose while
# hundreds of admissions queue behind it, and the proxy's threads share the test's process (and a
# loaded machine) with the agent; a timeout here is not what these tests are about.
PATIENT_TIMEOUT_S = 30.0


@pytest.fixture
def proxied(redis_url: str, run_dir: Path, shm_node: str) -> Iterator[tuple[Agent, RedisProxy, ClusterState]]:
    """An agent whose Redis is reached through a proxy that can lose or hold its answers."""
    proxy = RedisProxy(redis_url)
    agent = Agent(AgentConfig(shm_node, run_dir, proxy.url, 256 << 20, 64 << 20, max_instances=6, keep_warm=30,
                              data_dir=run_dir.parent / "data"), ClusterState(proxy.url, timeout=PATIENT_TIMEOUT_S))
    agent.start()
    yield agent, proxy, ClusterState(redis_url)
    agent.stop()
    proxy.close()


def fedavg(updates: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    return {k: sum(u[k].astype(np.float64) * c for u, c in zip(updates, samples)) / sum(samples) for k in updates[0]}


def batches(agent: Agent, call: str) -> tuple[float, float]:
    """(calls, uploads) the agent's batched Redis ``call`` ("reserve" or "accept") has made."""
    client = gateway(agent)
    try:
        return (metric(client, f'lifl_state_batch_size_count{{call="{call}"}}'),
                metric(client, f'lifl_state_batch_size_sum{{call="{call}"}}'))
    finally:
        client.close()


def test_a_batch_of_one_is_one_call(proxied: tuple[Agent, RedisProxy, ClusterState]) -> None:
    agent, _, state = proxied
    state.create_job(JobSpec("j", goal=1))
    rng = np.random.default_rng(1)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    update = random_model(rng)
    push(client, "j", 0, fmt.encode(update), 3)
    wait_for(lambda: state.version("j") == 1, what="version 1")
    assert batches(agent, "reserve") == (1, 1) and batches(agent, "accept") == (1, 1)
    _, model = read_model(client, "j")
    for name, tensor in update.items():
        np.testing.assert_array_equal(model[name], tensor)


def test_uploads_arriving_during_a_call_go_in_the_next_up_to_a_full_batch(
        proxied: tuple[Agent, RedisProxy, ClusterState]) -> None:
    """The first admission's call is held; the rest queue behind it: one full batch of
    ``MAX_BATCH``, then what is left; every upload is admitted, and its slot counted once."""
    agent, proxy, state = proxied
    extra = 40
    wanted = 1 + MAX_BATCH + extra
    state.create_job(JobSpec("j", goal=wanted))
    client = gateway(agent)
    blob = fmt.encode(random_model(np.random.default_rng(2)))
    put_model(client, "j", blob)
    proxy.hold_answer(state._reserve.sha)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(agent.config.socket_path))
    try:
        sock.sendall(encode_frame({"id": 0, **Hello("gateway", PROTOCOL).encode()}, 0))
        sock.sendall(encode_frame({"id": 1, **Admit("j", 0, len(blob), client="c0").encode()}, 0))
        wait_for(proxy.fired.is_set, what="the first admission's call reached Redis")
        sock.sendall(b"".join(encode_frame({"id": i + 1, **Admit("j", 0, len(blob), client=f"c{i}").encode()}, 0)
                              for i in range(1, wanted)))
        wait_for(lambda: agent.loop.call(lambda: len(agent._reserves._waiting.get("j", []))) == wanted - 1,
                 what="the other admissions queued behind the held call")
        proxy.release()
        replies = _read_frames(sock, wanted + 1)
    finally:
        sock.close()
    assert all(r["ok"] and r["op"] in ("hello_reply", "admitted") for r in replies), [r for r in replies if not r["ok"]][:3]
    assert batches(agent, "reserve") == (3, wanted)  # 1, then a full batch, then the rest
    text = gateway(agent).call(GetMetrics())[0].text
    buckets = {float(line.split('le="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith('lifl_state_batch_size_bucket{call="reserve"')}
    assert buckets[1.0] == 1 and buckets[128.0] == 2 and buckets[256.0] == 3  # sizes 1, 40 and exactly 256
    wait_for(lambda: state.job("j").reserved == 0, what="the closed connection's slots given back, once each")
    assert state.shard("j").inflight == {agent.node: 0}


def _read_frames(sock: socket.socket, n: int) -> list[dict]:
    import orjson

    buf, out = b"", []
    while len(out) < n:
        data = sock.recv(1 << 20)
        assert data, "the agent closed the connection"
        buf += data
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("<I", buf)[0]:
            size = struct.unpack_from("<I", buf)[0]
            out.append(orjson.loads(buf[4 : 4 + size]))
            buf = buf[4 + size :]
    return out


@pytest.mark.parametrize("script", ["_reserve", "_accept"])
def test_a_batch_whose_answer_is_lost_is_sent_again_and_counts_each_update_once(
        proxied: tuple[Agent, RedisProxy, ClusterState], script: str) -> None:
    """Redis runs the batch's script, then the connection breaks before the agent hears the
    answer: the agent sends the same batch again (its uploads' tokens make that harmless), and
    every client is acknowledged once, the round counts each update once, and its model is
    the exact FedAvg of what was acknowledged."""
    agent, proxy, state = proxied
    sent = 6  # concurrently, with the fault; then one more closes the round
    state.create_job(JobSpec("j", goal=sent + 1, leaf_fan_in=2))
    rng = np.random.default_rng(3)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    updates = [random_model(rng) for _ in range(sent + 1)]
    samples = [int(s) for s in rng.integers(1, 20, sent + 1)]
    state.redis.script_load(getattr(state, script).script)  # Redis runs it the first time it is sent
    proxy.lose_answer(getattr(state, script).sha)
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            c = gateway(agent)
            push(c, "j", 0, fmt.encode(updates[i]), samples[i])
            c.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(sent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert proxy.fired.is_set() and not errors, errors
    job, shard = state.job("j"), state.shard("j")
    assert (job.reserved, job.accepted, shard.counts, shard.inflight) == (sent, sent, {agent.node: sent}, {agent.node: 0})
    view = state.job_view("j")  # the round's duties read the same in one snapshot
    assert (view.job, view.shard) == (job, shard) and abs(view.now - state.now()) < 60
    push(client, "j", 0, fmt.encode(updates[sent]), samples[sent])
    wait_for(lambda: state.version("j") == 1, what="version 1")
    summary = state.job("j").last_round
    assert summary["updates"] == sent + 1 and summary["nodes"] == {agent.node: sent + 1}
    _, model = read_model(client, "j")
    expected = fedavg(updates, samples)
    for name in expected:
        np.testing.assert_allclose(model[name], expected[name], rtol=1e-5, atol=1e-7)
