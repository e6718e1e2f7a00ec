"""h2spec, the public HTTP/2 conformance suite, against a node's gRPC port as `lifl up` starts it
(1 MiB DATA frames advertised): every test passes, strict ones included. h2spec is built from
the module pinned in scripts/h2spec (scripts/install.sh builds it; so does this test when it is
missing or stale)."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import RunningNode

BUILD = Path(__file__).resolve().parents[1] / "scripts" / "h2spec" / "build.sh"
H2SPEC = Path(sys.executable).parent / "h2spec"
WAIT_S = 10  # h2spec's wait for each expected frame: generous, the machine may be loaded
CASES = {"strict": 146, "default": 145}  # what h2spec (the version pinned) runs with and without --strict


@pytest.fixture(scope="module")
def h2spec() -> Path:
    built = subprocess.run([str(BUILD), str(H2SPEC)], capture_output=True, text=True)
    if built.returncode:
        pytest.fail(f"building h2spec failed (Go 1.18+ is needed; scripts/install.sh installs it):\n{built.stdout}{built.stderr}")
    return H2SPEC


def run_h2spec(h2spec: Path, address: str, report: Path, *flags: str) -> list[tuple[str, str]]:
    """Every test case h2spec ran, as (name, outcome: passed, failed or skipped)."""
    host, port = address.rsplit(":", 1)
    done = subprocess.run([str(h2spec), "-h", host, "-p", port, "-o", str(WAIT_S), "-j", str(report), *flags],
                          capture_output=True, text=True, timeout=900)
    assert report.exists(), f"h2spec wrote no report:\n{done.stdout[-4000:]}{done.stderr}"
    cases = []
    text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", "?", report.read_text(errors="replace"))  # h2spec writes raw bytes of frames
    for suite in ET.fromstring(text).iter("testsuite"):
        for case in suite.iter("testcase"):
            outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            cases.append((f"{case.get('package')} {case.get('classname')}", outcome))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("mode", CASES)
def test_every_h2spec_test_passes(node: RunningNode, h2spec: Path, tmp_path: Path, mode: str) -> None:
    cases = run_h2spec(h2spec, node.grpc, tmp_path / "report.xml", *(["--strict"] if mode == "strict" else []))
    not_passed = [f"{outcome}: {name}" for name, outcome in cases if outcome != "passed"]
    assert not not_passed, "h2spec:\n" + "\n".join(not_passed)
    assert len(cases) == CASES[mode], f"h2spec ran {len(cases)} cases, not {CASES[mode]}"
