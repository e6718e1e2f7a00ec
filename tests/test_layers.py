"""Dependencies point one way: the import contracts of pyproject.toml ([tool.importlinter]),
checked by import-linter (lint-imports) over every import, lazy ones included.

The package's code lives in four folders that pyproject's package-dir maps into one package
(gateway/ is lifl.gateway, ...); import-linter reads a package from one folder, so the check
runs on a copy of the tree laid out as the package installs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"
CONTRACTS = [c["id"] for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's modules as they install, each package-dir folder copied to its package's place (the
    layers contract is exhaustive: a module missing from it breaks the contract)."""
    root = tmp_path_factory.mktemp("layout")
    folders = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info", "*_test.py")  # *_test.py: functions' tests
    for package, folder in sorted(folders.items(), key=lambda item: item[0].count(".")):
        target = root.joinpath(*package.split("."))
        if not target.exists():  # a subpackage of a folder copied already
            shutil.copytree(REPO / folder, target, ignore=ignore)
    return root


@pytest.mark.parametrize("contract", CONTRACTS)
def test_the_import_contract_is_kept(contract: str, installed_layout: Path) -> None:
    run = subprocess.run([str(LINT_IMPORTS), str(PYPROJECT), "--contract", contract, "--no-cache", "--no-logo"],
                         capture_output=True, text=True, cwd=installed_layout,
                         env={**os.environ, "PYTHONPATH": str(installed_layout)})
    assert run.returncode == 0 and "1 kept, 0 broken" in run.stdout, run.stdout + run.stderr

