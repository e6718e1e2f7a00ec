"""`lifl bench secagg` in a small configuration: lifl's secure round, its plain fixed-point round
and Flower's SecAgg+ (``SecAggPlusWorkflow`` with ``secaggplus_mod``) all complete with the same
clients and dropouts, and the figures are there (full figures: `lifl bench secagg`)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from lifl.bench import secagg
from lifl.cli import build_parser


@pytest.mark.parametrize("clients, dropout, dropped", [(20, 0.0, 0), (20, 0.1, 2), (100, 0.1, 10), (5, 0.2, 1), (7, 0.3, 2)])
def test_the_same_clients_drop_out_in_both_systems(clients: int, dropout: float, dropped: int) -> None:
    chosen = secagg.dropped_clients(clients, dropout)
    assert len(chosen) == dropped and len(set(chosen)) == dropped and all(0 <= i < clients for i in chosen)
    assert chosen == secagg.dropped_clients(clients, dropout)


def test_the_expected_mean_is_the_survivors_sample_weighted_mean() -> None:
    shapes = secagg.model_shapes(2000)
    assert shapes == {"weight": (1000,), "bias": (1000,)}
    want = secagg.expected_mean(shapes, [0, 3])
    a, b = secagg.client_update(shapes, 0), secagg.client_update(shapes, 3)
    weighted = (a["bias"].astype(np.float64) * 10 + b["bias"].astype(np.float64) * 13) / 23
    assert np.allclose(want["bias"], weighted) and secagg.max_abs_error(a, secagg.expected_mean(shapes, [0])) < 1e-9


@pytest.mark.parametrize("argv, named", [
    (["--clients", "2"], "at least 3"), (["--clients", "20,x"], "comma-separated list of client counts"),
    (["--clients", ""], "comma-separated list of client counts"),
    (["--dropouts", "0.5"], "[0, 0.5)"), (["--dropouts", "-0.1"], "[0, 0.5)"), (["--dropouts", "a"], "dropout fractions"),
])
def test_malformed_bench_arguments_are_refused_naming_the_problem(argv: list[str], named: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "secagg", *argv])
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("parameters, timeout, named", [(1999, 10.0, "--parameters"), (20_000, 0.5, "--stage-timeout"),
                                                        (20_000, 601.0, "--stage-timeout")])
def test_out_of_range_sizes_are_refused(parameters: int, timeout: float, named: str) -> None:
    args = argparse.Namespace(parameters=parameters, stage_timeout=timeout, clients=(5,), dropouts=(0.0,), no_flower=True,
                              json=True)
    with pytest.raises(SystemExit) as e:
        secagg.main(args)
    assert named in str(e.value)


@pytest.mark.slow
def test_a_small_secagg_run_against_flower() -> None:
    """Six clients of a 20,000-parameter model, none and one dropping out after sharing (each
    system then waits out one 3 s stage deadline)."""
    result = secagg.run(clients=(6,), dropouts=(0.0, 0.2), parameters=20_000, stage_timeout_s=3.0)
    assert result["parameters"] == 20_000 and len(result["runs"]) == 2
    for row in result["runs"]:
        dropped = len(secagg.dropped_clients(6, row["dropout"]))
        for system in ("lifl_plain", "lifl", "flower"):
            r = row[system]
            assert r["failures"] == 0 and r["round_s"] > 0 and r["server_cpu_s"] > 0, (system, r)
            assert r["client_cpu_s_p50"] > 0 and r["client_bytes_up"] > 80_000 and r["client_bytes_down"] > 80_000, (system, r)
            assert r["server_peak_bytes"] > 0
        assert row["lifl"]["max_abs_error"] < 2 ** -15 and row["flower"]["max_abs_error"] < 1e-3  # each one's quantization
        assert row["lifl"]["unmask_s"] > 0 and row["flower"]["unmask_s"] > 0
        assert row["lifl"]["secure"]["survivors"] == 6 - dropped and row["lifl"]["secure"]["dropped"] == dropped
        spread = row["lifl"]["unmasked_by"]  # leaves of two, each its own clients' self masks (and pair masks of a dropout)
        assert [t["role"] for t in spread] == ["leaf"] * len(spread) and len(spread) >= 2, spread
        assert sum(t["streams"] for t in spread) >= 6 - dropped
        assert row["lifl"]["secure"]["k"] == row["k"] and set(row["ratios"]) == {
            "secure_over_plain_server_cpu", "server_cpu_over_flower", "round_over_flower"}
    assert result["runs"][0]["lifl"]["exact"] is True  # no dropout: bit for bit the plain fixed-point round
    masking = result["masking"]
    assert masking["streams"] == result["runs"][0]["k"] + 1 and masking["masking_s"] > 0 and masking["ratio"] > 0
