"""lifl.flower.LiflFedAvg, the Flower bridge: conversions, rounds against a real lifl node, bad
configuration, a real Flower deployment against Flower's FedAvg, and `lifl bench flower-memory`.

The bridge runs in Flower's environment (flwr cannot share lifl's .venv), so each check runs there
as a subprocess that prints JSON; these tests are slow (the first one makes the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import OPERATOR_TOKEN, RunningNode
from lifl.bench import flower, flowermem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test makes the Flower environment

PRELUDE = """
import json, sys
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from lifl import errors
from lifl.flower import LiflFedAvg, global_record, npy_view, record_arrays, sample_count
from lifl.bench.flowermem import MODELS, synthetic_arrays, synthetic_grid

def failure(call):
    try:
        call()
    except errors.LiflError as e:
        return {"type": type(e).__name__, "code": e.code, "message": str(e)}
    return None
"""


def in_flower(code: str, setup: str = "", **env: str) -> Any:
    """Run ``code`` (after PRELUDE and ``setup``) in Flower's environment; what it prints last, as JSON."""
    python = flower.flower_env() / "python"
    done = subprocess.run([str(python), "-c", PRELUDE + setup + textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LIFL_TOKEN": OPERATOR_TOKEN, **env})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- conversions ------------------------------------------------------------------------------------------

WEIGHTS = [(5, 5), (5.0, 5), (2**53, 2**53), (0, "bad_weight"), (-3, "bad_weight"), (2.5, "bad_weight"),
           (True, "bad_weight"), ("7", "bad_weight"), (2**53 + 1, "bad_weight")]


@pytest.fixture(scope="module")
def conversions() -> dict[str, Any]:
    return in_flower(f"""
        weights = {{repr(v): (failure(lambda: sample_count(v, "num-examples")) or {{}}).get("code") or sample_count(v, "num-examples")
                   for v in {[w for w, _ in WEIGHTS]!r}}}
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        record = ArrayRecord({{"w": Array(a), "n": Array(np.array(7, np.int64)), "f": Array(np.asfortranarray(a.astype(np.float64)))}})
        views = record_arrays(record)
        shares = np.shares_memory(views["w"], np.frombuffer(record["w"].data, np.uint8))
        back = global_record({{"n": views["n"], "f": views["f"], "w": views["w"]}}, ["w", "n", "f"])
        print(json.dumps({{
            "weights": weights, "shares": bool(shares),
            "equal": all(np.array_equal(views[k], record[k].numpy()) for k in record),
            "keys": list(back), "dtypes": [back[k].dtype for k in back],
            "roundtrip": all(np.array_equal(back[k].numpy(), record[k].numpy()) for k in record),
            "uint8": failure(lambda: record_arrays(ArrayRecord({{"img": Array(np.zeros(3, np.uint8))}}))),
            "voids": failure(lambda: record_arrays(ArrayRecord({{"v": Array(dtype="float8", shape=(3,), stype="numpy.ndarray",
                                                                              data=Array(np.zeros(3, "V2")).data)}}))),
        }}))
    """)


@pytest.mark.parametrize("value,expected", WEIGHTS)
def test_a_reply_weight_is_a_positive_integer_sample_count(conversions: dict[str, Any], value: Any, expected: Any) -> None:
    assert conversions["weights"][repr(value)] == expected


def test_arrays_are_read_in_place_and_come_back_with_keys_order_and_dtypes(conversions: dict[str, Any]) -> None:
    assert conversions["shares"] and conversions["equal"]  # a view of Flower's own bytes
    assert conversions["keys"] == ["w", "n", "f"] and conversions["dtypes"] == ["float32", "int64", "float64"]
    assert conversions["roundtrip"]
    assert conversions["uint8"]["code"] == "unsupported_dtype" and "'img'" in conversions["uint8"]["message"]
    assert conversions["voids"]["code"] == "unsupported_dtype" and "float8" in conversions["voids"]["message"]  # not bfloat16


# -- rounds against a real node -----------------------------------------------------------------------------

ROUND = """
shapes = MODELS["tiny"]()
def one_round(strategy, fail=()):
    grid = synthetic_grid(shapes, 4, fail=fail)
    train = strategy.streaming(grid) if isinstance(strategy, LiflFedAvg) else grid
    arrays = ArrayRecord({k: Array(v) for k, v in synthetic_arrays(shapes, 99).items()})
    replies = train.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    held = [bool(r.content.array_records) for r in replies if not r.has_error()]
    aggregated, metrics = strategy.aggregate_train(1, replies)
    return aggregated, held, metrics
kwargs = {"min_train_nodes": 4, "min_available_nodes": 4, "fraction_evaluate": 0.0}
"""


def test_the_bridge_aggregates_a_round_like_flower_fedavg(node: RunningNode) -> None:
    out = in_flower("""
        from flwr.serverapp.strategy import FedAvg
        import os
        bridge = LiflFedAvg(os.environ["GATEWAY"], job="fl-a", **kwargs)
        ours, held, metrics = one_round(bridge)
        theirs, _, _ = one_round(FedAvg(**kwargs))
        print(json.dumps({"held": held, "keys": list(ours) == list(theirs), "job": bridge.lifl.job("fl-a"),
                          "dtypes": {k: ours[k].dtype for k in ours},
                          "differences": {k: float(np.max(np.abs(ours[k].numpy() - theirs[k].numpy()))) for k in ours},
                          "metrics": dict(metrics or {})}))
    """, ROUND, GATEWAY=node.http)
    assert out["held"] == [False] * 4  # the ServerApp kept no reply's arrays
    assert out["keys"]
    differences = out["differences"]
    assert differences.pop("bn.num_batches_tracked") < 0.5  # lifl averages an integer tensor to an integer
    assert max(differences.values()) < 1e-6, differences
    assert out["dtypes"]["bn.num_batches_tracked"] == "int64"  # lifl keeps the model's dtypes
    assert out["job"]["goal"] == 4 and out["job"]["version"] == 1 and out["job"]["last_round"]["updates"] == 4


def test_a_round_short_of_replies_closes_at_its_deadline_with_the_others(node: RunningNode) -> None:
    out = in_flower("""
        import os
        bridge = LiflFedAvg(os.environ["GATEWAY"], job="fl-b", round_deadline_s=2.0, **kwargs)
        ours, held, _ = one_round(bridge, fail={1})
        status = bridge.lifl.job("fl-b")
        print(json.dumps({"aggregated": ours is not None, "last": status["last_round"], "version": status["version"]}))
    """, ROUND, GATEWAY=node.http)
    assert out["aggregated"] and out["version"] == 1
    assert out["last"]["outcome"] == "partial" and out["last"]["updates"] == 3


def test_bad_configuration_fails_with_a_clear_error() -> None:
    port = flower.free_ports(1)[0]
    out = in_flower(f"""
        print(json.dumps({{
            "none": failure(lambda: LiflFedAvg("")),
            "unreachable": failure(lambda: LiflFedAvg("127.0.0.1:{port}")),
        }}))
    """)
    assert out["none"]["code"] == "no_gateway" and "lifl gateway" in out["none"]["message"]
    assert out["unreachable"]["type"] == "Unavailable" and out["unreachable"]["code"] == "unreachable"
    assert f"127.0.0.1:{port}" in out["unreachable"]["message"]


def test_a_model_lifl_cannot_aggregate_is_refused_before_anything_is_sent(node: RunningNode) -> None:
    out = in_flower("""
        import os
        bridge = LiflFedAvg(os.environ["GATEWAY"], job="fl-c", min_train_nodes=1, min_available_nodes=1)
        grid = synthetic_grid({"img": (3,)}, 1)
        arrays = ArrayRecord({"img": Array(np.zeros(3, np.uint8))})
        messages = bridge.configure_train(1, arrays, ConfigRecord(), grid)
        print(json.dumps({"error": failure(lambda: bridge.streaming(grid).send_and_receive(messages)),
                          "pushed": len(grid.sent), "jobs": bridge.lifl.jobs()}))
    """, GATEWAY=node.http)
    assert out["error"]["code"] == "unsupported_dtype" and out["pushed"] == 0 and "fl-c" not in out["jobs"]


# -- FlowerTune-style LoRA ---------------------------------------------------------------------------------------

LORA_CLIENTS, LORA_ROUNDS = 3, 3


def test_a_lora_job_in_bfloat16_trains_through_the_bridge_like_flower_fedavg(node: RunningNode) -> None:
    """tests/lora_clients.py: 3 clients train a LoRA adapter for 3 rounds and reply with it in
    bfloat16. Each round's replies go through the bridge, and the same replies, widened to float32
    (Flower's FedAvg multiplies arrays, and numpy has no bfloat16), through Flower's FedAvg."""
    out = in_flower(f"""
        import os, sys
        import ml_dtypes
        from flwr.app import Message, RecordDict
        from flwr.serverapp.strategy import FedAvg
        sys.path.insert(0, os.environ["TESTS"])
        import lora_clients as lc

        def ordered(bits):  # bfloat16 bits as integers whose differences count ulps
            bits = bits.astype(np.int32)
            return np.where(bits & 0x8000, 0x8000 - bits, bits)

        clients, model = {LORA_CLIENTS}, lc.lora_model()
        kept = []  # the round's replies widened to float32, for Flower's FedAvg
        def answer(position, message):
            reply = lc.train(model, message.content["arrays"], position % clients)
            kept.append(Message(RecordDict({{"arrays": lc.widened(reply["arrays"]), "metrics": reply["metrics"]}}),
                                reply_to=message))
            return reply
        grid = synthetic_grid({{}}, clients, answer=answer)
        kwargs = {{"min_train_nodes": clients, "min_available_nodes": clients, "fraction_evaluate": 0.0}}
        bridge, flower = LiflFedAvg(os.environ["GATEWAY"], job="lora", **kwargs), FedAvg(**kwargs)
        data = torch.cat([lc.sequences(c, lc.SEQUENCES_PER_CLIENT) for c in range(clients)])
        arrays = lc.adapter_record(model)
        keys, losses, worst, equal, elements = list(arrays), [], 0, 0, 0
        for server_round in range(1, {LORA_ROUNDS} + 1):
            lc.load_adapter(model, arrays)
            losses.append(lc.loss(model, data))
            kept.clear()
            replies = bridge.streaming(grid).send_and_receive(bridge.configure_train(server_round, arrays, ConfigRecord(), grid))
            ours, _ = bridge.aggregate_train(server_round, replies)
            theirs, _ = flower.aggregate_train(server_round, kept)
            for k in keys:
                a = ordered(ours[k].numpy().view(np.uint16))
                b = ordered(theirs[k].numpy().astype(ml_dtypes.bfloat16).view(np.uint16))
                worst, equal, elements = max(worst, int(np.abs(a - b).max())), equal + int((a == b).sum()), elements + a.size
            arrays = ours
        lc.load_adapter(model, arrays)
        losses.append(lc.loss(model, data))
        print(json.dumps({{"keys": list(arrays) == keys and len(keys) == 8, "dtypes": sorted({{arrays[k].dtype for k in keys}}),
                          "job": bridge.lifl.job("lora"), "losses": losses, "worst_ulps": worst, "equal": equal,
                          "elements": elements}}))
    """, "import torch\n" + ROUND, GATEWAY=node.http, TESTS=str(Path(__file__).parent))
    assert out["keys"] and out["dtypes"] == ["bfloat16"]  # the adapter's 8 arrays, back in bfloat16
    assert out["job"]["version"] == LORA_ROUNDS and out["job"]["last_round"]["updates"] == LORA_CLIENTS
    assert out["worst_ulps"] <= 1, out  # Flower sums in float32: at most one rounding apart
    assert out["equal"] >= 0.99 * out["elements"], out
    assert out["losses"][-1] < out["losses"][0], out["losses"]  # the federated adapter learned


# -- a real Flower deployment -----------------------------------------------------------------------------------


def test_a_flower_deployment_trains_through_the_bridge_like_flower_fedavg(node: RunningNode, tmp_path: Path) -> None:
    """Digits, 2 SuperNodes, 3 rounds on the same seeds: Flower's FedAvg and the bridge."""
    setup = {"target": 1.01, "max_rounds": 3, "clients": 6, "goal": 2, "alpha": 100.0, "seed": 0, "max_minutes": 8.0,
             "supernodes": 2}
    theirs = flower.run_flower(**setup, workdir=tmp_path / "fedavg")
    ours = flower.run_flower(**setup, workdir=tmp_path / "bridge", lifl_gateway=node.http, lifl_token=OPERATOR_TOKEN)
    assert ours["system"] == "flower+lifl" and theirs["system"] == "flower"
    assert ours["rounds"] == theirs["rounds"] == 3
    for a, b in zip(ours["series"], theirs["series"], strict=True):
        assert a["round"] == b["round"] and a["accuracy"] == pytest.approx(b["accuracy"], abs=0.01)
    assert node.json("GET", "/v1/jobs")[1]["jobs"], "the bridge made no lifl job"


# -- the memory bench ------------------------------------------------------------------------------------------


def test_the_memory_bench_reports_both_sides_and_the_node_shared_memory() -> None:
    result = flowermem.run("tiny", 3)
    assert result["model"] == "tiny" and result["replies"] == 3 and result["parameters"] == 8 * 9 + 320 + 10
    for side in ("flower_fedavg", "lifl_bridge"):
        r = result[side]
        assert set(r) >= {"baseline_rss_mb", "peak_rss_mb", "peak_above_baseline_mb", "aggregate_s"}
        assert r["peak_rss_mb"] >= r["baseline_rss_mb"] > 0
    assert result["flower_fedavg"]["fc_bias_head"] == pytest.approx(result["lifl_bridge"]["fc_bias_head"], abs=1e-4)
    assert result["lifl_node_shm"]["used_peak_mb"] >= 0 and "saved_mb" in result
