"""The client SDK installs without the server's dependencies: lifl/client/pyproject.toml builds
the lifl-client wheel, which goes with --no-deps into a fresh environment that has numpy and
nothing else, and there converts models to blobs and back. No network: the build uses this
environment's setuptools, the install this wheel only."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest

LIFL = Path(__file__).resolve().parent.parent / "lifl"
SERVER_ONLY = ("redis", "posix_ipc", "prometheus_client", "_cffi_backend", "grpc", "google.protobuf", "hpack",
               "lifl.kernels", "lifl.store", "lifl.state")

IN_THE_FRESH_ENVIRONMENT = """
import importlib.util, json, sys
import numpy as np
import lifl.client
from lifl.client import from_blob, to_blob
from lifl.errors import Unprocessable

expected = json.loads(sys.argv[1])
tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([7], np.int64)}
back = from_blob(to_blob(tensors, {"client": "c1"}))
assert all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items()), back
try:
    from_blob(to_blob({"w": np.array([1.0, np.nan], np.float32)}))
    raise AssertionError("a NaN was accepted")
except Unprocessable as e:
    assert e.code == "non_finite", e
def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
print(json.dumps({
    "file": lifl.client.__file__,
    "missing": [m for m in expected["needed"] if not found(m)],
    "present": [m for m in expected["absent"] if found(m)],
}))
"""


def _lifl_imports(path: Path) -> set[str]:
    """The lifl modules a module imports, lazily or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lifl"):
            found.update(f"{node.module}.{a.name}" if (LIFL.parent / node.module.replace(".", "/") / f"{a.name}.py").exists()
                         else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lifl"))
    return found


def _needed_by_the_sdk() -> set[str]:
    """Every lifl module that lifl.client's modules reach, through lazy imports too."""
    needed, todo = set(), [f"lifl.client.{p.stem}" if p.stem != "__init__" else "lifl.client"
                           for p in (LIFL / "client").glob("*.py")]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        relative = Path(*name.split("."))
        path = LIFL.parent / relative.with_suffix(".py")
        todo.extend(_lifl_imports(path if path.exists() else LIFL.parent / relative / "__init__.py"))
    return needed


@pytest.mark.slow
def test_the_sdk_wheel_installs_and_runs_with_numpy_alone(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(LIFL, source / "lifl", ignore=shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(source / "lifl" / "client")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("lifl_client-*.whl")

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # numpy, and nothing else of this environment, is visible there
    numpy_only = tmp_path / "numpy-only"
    numpy_only.mkdir()
    numpy_dir = Path(np.__file__).parent
    for part in (numpy_dir, numpy_dir.with_name("numpy.libs")):
        if part.exists():
            (numpy_only / part.name).symlink_to(part)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "numpy-only.pth").write_text(f"{numpy_only}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, cwd=tmp_path)

    needed = sorted(_needed_by_the_sdk())
    run = subprocess.run([python, "-c", IN_THE_FRESH_ENVIRONMENT, json.dumps({"needed": needed, "absent": SERVER_ONLY})],
                         capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert Path(report["file"]).is_relative_to(site)  # the installed SDK, not this checkout
    assert report["missing"] == []  # every lifl module the SDK imports, lazily too, is in the wheel
    assert report["present"] == []  # and none of the server's
