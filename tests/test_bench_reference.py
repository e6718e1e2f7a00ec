"""The raw-socket reference of `lifl bench dataplane`: its sink and both ways of sending to it."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from lifl.bench.dataplane import Bench, print_table

SIZE = 3 << 20  # several socket buffers' worth, so that sendall() waits for the sink


@pytest.mark.parametrize("blocking", [False, True])
def test_raw_sink_receives_every_byte_and_acknowledges(blocking: bool) -> None:
    bench = SimpleNamespace(tls_files=None, http=SimpleNamespace(timeout=30.0), raw_send=Bench.raw_send)
    update = bytes(range(256)) * (SIZE // 256)
    sinks: list[subprocess.Popen] = []
    raw, pid = Bench.raw_sink(bench, update, sinks, tls=False, blocking=blocking)  # type: ignore[arg-type]
    try:
        assert pid == sinks[0].pid
        # the reference sends the way lifl's client does (a socket timeout); the naive one blocks
        assert raw.gettimeout() == (None if blocking else 30.0)
        for _ in range(3):  # one transfer was already made (the warm-up); each is acknowledged
            assert Bench.raw_send(raw, update) > 0
    finally:
        raw.close()
        for process in sinks:
            process.kill()
            process.wait()


def test_raw_send_refuses_a_sink_that_went_away() -> None:
    bench = SimpleNamespace(tls_files=None, http=SimpleNamespace(timeout=30.0), raw_send=Bench.raw_send)
    sinks: list[subprocess.Popen] = []
    raw, _ = Bench.raw_sink(bench, bytes(SIZE), sinks, tls=False)  # type: ignore[arg-type]
    sinks[0].kill()
    sinks[0].wait()
    try:
        with pytest.raises(OSError):  # ConnectionError: reset, or closed without the acknowledgement
            for _ in range(3):
                Bench.raw_send(raw, bytes(SIZE))
    finally:
        raw.close()


def test_table_reports_both_references(capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"size_mb": 83.3, "raw_tcp_ms": 20.0, "raw_tcp_naive_ms": 26.0, "ingest_http_ms": 24.0, "ingest_grpc_ms": 25.0,
               "ingest_grpcio_ms": 40.0, "memcpy_ms": 8.0, "aggregate_ms": 5.0, "accumulate_single_ms": 10.0, "handoff_us": 400.0,
               "ratios": {"ingest_http": 1.2, "raw_tcp_naive": 1.3}, "memory": {"per_update_ratio": 1.01}, "targets_met": {}}
    print_table({"sizes": {"resnet34": figures}, "peak_rss_mb": 500.0})
    out = capsys.readouterr().out
    assert "raw_tcp_naive_ms" in out and "26.0" in out and "'raw_tcp_naive': 1.3" in out


def test_fixed_point_figures_compare_with_the_float_fold_and_stay_within_the_error_bound() -> None:
    import numpy as np

    from lifl import format as fmt
    from lifl.bench.dataplane import FIXED_POINTS, fixed_point_figures

    rng = np.random.default_rng(3)
    first, second = (fmt.encode({"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)})
                     for _ in range(2))
    figures = fixed_point_figures(first, second, reps=2)
    assert figures["float_fold_ms"] > 0
    for fp in FIXED_POINTS:
        path = figures[f"f{fp.frac_bits}_w{fp.width}"]
        assert path["fold_ms"] > 0 and path["vs_float"] > 0
        assert 0 < path["mean_abs_error"] <= path["max_abs_error"] <= path["error_bound"] == 2.0 ** -(fp.frac_bits + 1)


def test_table_reports_the_fixed_point_path(capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"size_mb": 44.7, "raw_tcp_ms": 20.0, "raw_tcp_naive_ms": 26.0, "ingest_http_ms": 24.0, "ingest_grpc_ms": 25.0,
               "ingest_grpcio_ms": 40.0, "memcpy_ms": 8.0, "aggregate_ms": 5.0, "accumulate_single_ms": 10.0, "handoff_us": 400.0,
               "ratios": {}, "memory": {"per_update_ratio": 1.01}, "targets_met": {},
               "fixed_point": {"float_fold_ms": 4.0, "f16_w32": {"fold_ms": 9.0, "vs_float": 2.25, "max_abs_error": 7.6e-6,
                                                                  "mean_abs_error": 3.8e-6, "error_bound": 7.63e-6}}}
    print_table({"sizes": {"resnet18": figures}, "peak_rss_mb": 500.0})
    out = capsys.readouterr().out
    assert "float 4.0 ms" in out and "f16_w32: 9.0 ms (2.25x)" in out
