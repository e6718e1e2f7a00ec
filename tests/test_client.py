"""The client SDK: model conversions, and one client's side of a round against a real node."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import RunningNode, wait_for
from lifl import kernels
from lifl.client import Gateway, Participant, RetryPolicy, from_blob, to_blob
from lifl.errors import Overloaded


def test_numpy_dict_round_trip_is_a_view_of_the_blob() -> None:
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "steps": np.array(7, np.int64)}
    blob = to_blob(state)
    back = from_blob(blob)
    np.testing.assert_array_equal(back["w"], state["w"])
    assert back["steps"] == 7 and np.shares_memory(back["w"], np.frombuffer(blob, np.uint8))


def test_torch_state_dict_round_trip_keeps_dtypes_including_bf16() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = dict(model.state_dict())
    state["half"] = torch.randn(5).to(torch.bfloat16)
    blob = to_blob(state)
    layout = kernels.validate(blob)
    assert {e.spec.name: e.spec.dtype.name for e in layout.entries}["half"] == "BF16"
    assert {e.spec.name: e.spec.dtype.name for e in layout.entries}["1.num_batches_tracked"] == "I64"
    back = from_blob(blob, as_torch=True)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    model.load_state_dict({k: v for k, v in back.items() if k != "half"})  # usable as is
    base = np.frombuffer(blob, np.uint8).ctypes.data  # the blob was writable: no copy was needed
    assert all(base <= t.data_ptr() < base + len(blob) for t in back.values())


def test_to_blob_reads_cpu_tensors_in_place() -> None:
    big = torch.ones(1 << 20)
    blob = to_blob({"big": big})
    assert len(blob) - kernels.validate(blob).data_start == big.numel() * 4


@pytest.mark.slow
def test_participant_round_and_stale_retrain(node: RunningNode) -> None:
    gw = Gateway(node.http)
    gw.create_job("p", 2)
    gw.set_model("p", to_blob({"w": torch.zeros(10)}))
    seen = []

    def train(state: dict, version: int) -> tuple[dict, int]:
        seen.append(version)
        return {"w": state["w"] + 1.0}, 10

    clients = [Participant(node.http, "p", "a", as_torch=True), Participant(node.grpc, "p", "b", protocol="grpc", as_torch=True)]
    results = [c.run_round(train) for c in clients]
    assert [r.outcome for r in results] == ["accepted", "accepted"] and seen == [0, 0]
    assert clients[0].wait_for_version(0, timeout=10) == 1
    version, blob = gw.model("p")
    assert version == 1 and from_blob(blob)["w"][0] == 1.0
    slow = Participant(node.http, "p", "c")

    def train_while_the_world_moves_on(state: dict, version: int) -> tuple[dict, int]:
        for i in range(2):  # two other clients finish version 1's round meanwhile
            gw.push("p", to_blob({"w": np.full(10, 5.0, np.float32)}), client=f"x{i}", samples=1, base_version=1)
        wait_for(lambda: gw.job("p")["version"] == 2, timeout=10, what="version 2")
        return state, 1

    result = slow.run_round(train_while_the_world_moves_on)
    assert (result.outcome, result.version) == ("stale", 2)  # pull and retrain
    for c in [*clients, slow]:
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_participant_honours_retry_after_then_gives_up(node: RunningNode, protocol: str) -> None:
    gw = Gateway(node.http)
    gw.create_job("r", 3, max_inflight=1)
    gw.set_model("r", to_blob({"w": np.zeros(4, np.float32)}))
    gw.push("r", to_blob({"w": np.ones(4, np.float32)}), client="first", samples=1, base_version=0)  # held: budget used
    p = Participant(node.http if protocol == "http" else node.grpc, "r", "second", protocol=protocol,
                    retry=RetryPolicy(max_elapsed_s=2.5))
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as info:
        p.run_round(lambda state, version: (state, 1))
    assert info.value.retry_after >= 1 and time.monotonic() - t0 >= 1.0  # it waited Retry-After before trying again
    assert gw.job("r")["round"]["leases"] == 0  # and gave its lease back
    p.close()
