"""lifl.bench.flower: Flower's deployment engine running `lifl demo`'s job, and its measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from lifl.bench import flower
from lifl.bench.flower import _Stat, _toml_value, free_ports, summarize, tree, tree_cpu_s


def test_tree_counts_each_process_once_parents_first() -> None:
    table = {
        1: _Stat("init", 0, 0, 9.0, 0.0),
        10: _Stat("flower-superlin", 1, 0, 2.0, 3.0),  # 3.0: what it has reaped (an exited child)
        11: _Stat("flower-superexe", 10, 0, 1.0, 0.5),
        12: _Stat("flwr-serverapp", 11, 0, 4.0, 0.0),  # a zombie still counts its own time
        20: _Stat("flower-supernod", 1, 0, 7.0, 0.0),
    }
    assert tree(table, 10) == [10, 11, 12]
    assert tree_cpu_s(table, 10) == pytest.approx(2.0 + 3.0 + 1.0 + 0.5 + 4.0)
    assert tree(table, 99) == [] and tree_cpu_s(table, 99) == 0.0


def test_tree_cpu_keeps_an_exited_grandchild_time() -> None:
    """A grandchild that burns CPU and is waited for still counts, in its parent's reaped time."""
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {burn!r}]); "
                                                     "print('reaped', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "reaped"
        table = flower._scan()
        assert tree(table, parent.pid) == [parent.pid]  # the grandchild is gone
        assert tree_cpu_s(table, parent.pid) >= 0.3
    finally:
        parent.kill()
        parent.wait()


def test_summarize_times_from_flwr_run() -> None:
    t0 = 1000.0
    events = [
        {"event": "start", "t": t0 + 2},
        {"event": "round", "t": t0 + 3, "round": 0, "accuracy": 0.1, "server_cpu_s": 5.0},
        {"event": "round_start", "t": t0 + 3, "round": 1},
        {"event": "round", "t": t0 + 13, "round": 1, "accuracy": 0.6, "send_receive_s": 9.5, "aggregate_s": 0.01,
         "replies": 10, "failures": 0, "clients": {"startup_s": 4.0, "data_s": 1.0, "train_s": 1.5}, "server_cpu_s": 7.0},
        {"event": "round_start", "t": t0 + 13, "round": 2},
        {"event": "round", "t": t0 + 25, "round": 2, "accuracy": 0.92, "send_receive_s": 11.5, "aggregate_s": 0.03,
         "replies": 9, "failures": 1, "clients": {"startup_s": 5.0, "data_s": 1.0, "train_s": 1.5}, "server_cpu_s": 9.0},
        {"event": "done", "t": t0 + 25},
    ]
    s = summarize(events, t0, 0.9)
    assert s["reached"] and s["time_to_accuracy_s"] == 25.0 and s["rounds"] == 2 and s["final_accuracy"] == 0.92
    assert s["first_round_t"] == t0 + 3 and s["round_s_mean"] == 11.0 and s["send_receive_s_mean"] == 10.5
    assert s["clientapp_s_mean"] == {"startup_s": 4.5, "data_s": 1.0, "train_s": 1.5} and s["messages"] == 20
    assert [p["round"] for p in s["series"]] == [0, 1, 2]
    assert s["series"][1] == {"t": 13.0, "round": 1, "accuracy": 0.6, "server_cpu_s": 7.0}
    missed = summarize(events, t0, 0.95)
    assert not missed["reached"] and missed["time_to_accuracy_s"] is None and missed["rounds"] == 2


def test_run_config_is_toml_and_ports_are_distinct() -> None:
    config = {"events": '/tmp/a "b"/events.jsonl', "goal": 10, "alpha": 0.5, "deadline": 1795511693.74, "flag": True}
    assert tomllib.loads("".join(f"{k} = {_toml_value(v)}\n" for k, v in config.items())) == config
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


# -- against real Flower processes ----------------------------------------------------------------------


def _flower_processes() -> set[tuple[int, str]]:
    """Every process (zombies too) running a Flower program, by pid and name."""
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                comm = Path(entry.path, "comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith(("flower-", "flwr-")):
                out.add((int(entry.name), comm))
    return out


def _assert_nothing_left(workdir: Path, before: set[tuple[int, str]]) -> None:
    assert flower.runs_of(str(workdir.resolve())) == []
    assert _flower_processes() - before == set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                assert str(workdir) not in Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                pass


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_app_samples_clients_and_spreads_them_over_supernodes() -> None:
    """The ServerApp's sampling, in the Flower environment (flwr is not installed in lifl's)."""
    python = flower.flower_env() / "python"
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import server_app as s\n"
            "print(json.dumps([s.sample_clients(list(range(3, 40)), 10, 0, r) for r in (1, 1, 2)] + [s.spread([5, 6, 7], [20, 10])]))")
    out = subprocess.run([str(python), "-c", code, str(flower.APP_DIR)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, again, second, spread = json.loads(out.stdout)
    assert first == again != second
    assert len(set(first)) == 10 and set(first) <= set(range(3, 40))
    assert spread == [[5, 20], [6, 10], [7, 20]]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run makes the Flower environment (pip install flwr)
def test_flower_reaches_the_target_and_leaves_no_process(tmp_path: Path) -> None:
    before = _flower_processes()
    # few, IID-ish clients so that two rounds reach 50 %: the run, not the learning, is under test
    r = flower.run_flower(target=0.5, clients=6, goal=2, alpha=100.0, seed=0, max_minutes=5.0, workdir=tmp_path, supernodes=2)
    assert r["system"] == "flower" and r["target_accuracy"] == 0.5
    assert r["reached"] and r["final_accuracy"] >= 0.5 and r["rounds"] >= 1
    assert 0 < r["time_to_accuracy_s"] <= r["wall_s"]
    for key in ("aggregation_cpu_s", "server_cpu_s_per_round", "server_peak_memory_mb", "client_cpu_s", "startup_s",
                "infra_startup_s", "run_startup_s"):
        assert r[key] > 0, key
    assert r["server_cpu_to_accuracy_s"] <= r["aggregation_cpu_s"]
    assert r["startup_s"] == pytest.approx(r["infra_startup_s"] + r["run_startup_s"], abs=5.0)
    assert set(r["server_peak_memory_by_program_mb"]) >= {"flower-superlink", "flwr-serverapp"}
    assert r["client_cpu_by_program_s"]["flwr-clientapp"] > 0
    assert r["clientapp_processes"] == 2 * r["rounds"]  # one ClientApp process per message
    series = r["series"]
    assert [p["round"] for p in series] == list(range(r["rounds"] + 1))
    assert all(a["t"] <= b["t"] and a["server_cpu_s"] <= b["server_cpu_s"] for a, b in zip(series, series[1:]))
    assert series[-1]["accuracy"] >= 0.5
    _assert_nothing_left(tmp_path, before)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failing_serverapp_is_reported_and_everything_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_test_split(path: Path, clients: int, alpha: float, seed: int) -> Path:
        np.savez(path, x0=np.zeros((2, 1, 8, 8), np.float32), y0=np.zeros(2, np.int64))
        return path

    monkeypatch.setattr(flower, "save_split", no_test_split)
    before = _flower_processes()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="the ServerApp failed: KeyError"):
        flower.run_flower(target=0.5, clients=1, goal=1, max_minutes=5.0, workdir=tmp_path)
    assert time.monotonic() - t < 240  # noticed when it fails, not at the deadline
    _assert_nothing_left(tmp_path, before)
