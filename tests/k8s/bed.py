"""The Kubernetes test bed (scripts/k8s-testenv.sh) for the k8s suites: its module fixture, with
lifl's manifests installed and KIngresses marked ready, and helpers to run things inside it.

A suite imports the fixture (``from k8s.bed import testbed``); with module scope, each suite gets
the bed once (started here unless a usable one already was, then left as found). The bed has the real node
``real1`` beside the kwok nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
TESTENV = str(ROOT / "scripts" / "k8s-testenv.sh")
STATE = Path(os.environ.get("LIFL_TESTENV_DIR", "/run/lifl-testenv"))
KUBECONFIG = STATE / "kubeconfig"
NETNS = os.environ.get("LIFL_TESTENV_NETNS", "lifl-testenv")
REAL_NODE = "real1"
REAL_NODE_LABEL = "lifl.dev/real-node"
# what the real node's kubelet sets on the host, which `down` restores
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
# lifl's own workloads in the manifests, simulated on the kwok nodes: on the real node they would
# run for real, beside the operator and Redis the tests start themselves
# Every suite on the bed: its first test's setup brings the bed up (images built, a cluster
# started: minutes on a loaded machine, bounded by those steps' own timeouts), so a test's time
# limit counts its own body only.
SUITE_MARKS = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.root, pytest.mark.timeout(300, func_only=True),
               pytest.mark.skipif(os.geteuid() != 0, reason="the test bed needs root (network namespaces)")]
LIFL_WORKLOADS = (("daemonset", "lifl-node"), ("deployment", "lifl-operator"), ("deployment", "lifl-redis"))
NODE_MANIFEST = ROOT / "manifests" / "node.yaml"
# The real node's stand-in for its host's file system, in the bed's state (the script's NODE_DIR,
# which `down` removes): install_manifests points lifl's node DaemonSet's host directories there,
# so that a node pod on the real node never writes into this machine's /run/lifl or /var/lib/lifl
# (an earlier bed left /var/lib/lifl 0700, which `lifl up`'s redis-server could not pass).
REAL_NODE_HOST_ROOT = STATE / REAL_NODE / "host"


def lifl_host_dirs() -> dict[str, Path]:
    """The host directories lifl's node DaemonSet makes on a real deployment, by volume name: its
    DirectoryOrCreate hostPaths in the manifest (/run/lifl, /var/lib/lifl)."""
    (daemonset,) = [d for d in yaml.safe_load_all(NODE_MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    return {v["name"]: Path(v["hostPath"]["path"]) for v in daemonset["spec"]["template"]["spec"]["volumes"]
            if v.get("hostPath", {}).get("type") == "DirectoryOrCreate"}


LIFL_HOST_DIRS = lifl_host_dirs()
REAL_NODE_LIFL_DIRS = {name: REAL_NODE_HOST_ROOT / path.relative_to("/") for name, path in LIFL_HOST_DIRS.items()}


def inside(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run([TESTENV, "exec", *argv], capture_output=True, text=True, **{"timeout": 120, **kwargs})


def kubectl(*argv: str, stdin: str | None = None) -> str:
    run = inside("kubectl", *argv, input=stdin)
    assert run.returncode == 0, f"kubectl {' '.join(argv)}: {run.stderr}"
    return run.stdout


def get(*argv: str) -> dict[str, Any]:
    return json.loads(kubectl("get", *argv, "-o", "json"))


def maybe(*argv: str) -> dict[str, Any] | None:
    run = inside("kubectl", "get", *argv, "-o", "json")
    return json.loads(run.stdout) if run.returncode == 0 else None


class Background:
    """A process inside the test bed, stopped at the end."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix=f"lifl-{name}-", suffix=".log", delete=False)
        self.argv, self.env = argv, env or {}
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        env_args = [f"{k}={v}" for k, v in self.env.items()]
        return subprocess.Popen([TESTENV, "exec", "env", *env_args, *self.argv], stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        self.stop()
        self.proc = self._start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")


def sysctls() -> dict[str, str]:
    return {name: (Path("/proc/sys") / name).read_text().strip() for name in KUBELET_SYSCTLS}


def leftovers() -> list[str]:
    """What of a bed that is down is still on the host: mounts under its state, cgroups of its
    real node, processes naming its state (its daemons, containerd's shims), the real node's lifl
    directories."""
    found = [line for line in Path("/proc/self/mounts").read_text().splitlines()
             if line.split()[1] == str(STATE) or line.split()[1].startswith(f"{STATE}/")]
    found += [str(directory) for directory in REAL_NODE_LIFL_DIRS.values() if directory.exists()]
    found += [str(path) for path in Path("/sys/fs/cgroup").glob(f"*/{NETNS}")]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(STATE) in argv:
            found.append(f"pid {cmdline.parent.name}: {argv}")
    return found


def install_manifests() -> None:
    """lifl's CRDs, workloads and Knative flags (manifests/), its workloads kept on the kwok nodes:
    the real node is tainted while they are installed and pinned, so that none lands on it. The
    node DaemonSet's host directories are the real node's own (REAL_NODE_LIFL_DIRS)."""
    taint = f"{REAL_NODE_LABEL}-installing=true:NoSchedule"
    kubectl("taint", "node", REAL_NODE, taint)
    try:
        kubectl("apply", "-k", str(ROOT / "manifests"))
        volumes = [{"name": name, "hostPath": {"path": str(path)}} for name, path in REAL_NODE_LIFL_DIRS.items()]
        kubectl("patch", "daemonset", "lifl-node", "-n", "lifl-system", "--type", "strategic",  # merges volumes by name
                "-p", json.dumps({"spec": {"template": {"spec": {"volumes": volumes}}}}))
        for kind, name in LIFL_WORKLOADS:
            kubectl("patch", kind, name, "-n", "lifl-system", "--type", "merge",
                    "-p", json.dumps({"spec": {"template": {"spec": {"nodeSelector": {"type": "kwok"}}}}}))
    finally:
        kubectl("taint", "node", REAL_NODE, f"{taint}-")


def usable() -> bool:
    """Whether a bed that is up can serve the suites: its API server answers and its real node is
    registered. One that cannot is a leftover (its namespace gone with a machine that was reset,
    its daemons killed with a run, or an `up` without `--real-node`). One that is only slow to
    answer is not."""
    try:
        return inside("kubectl", "get", "--raw", "/readyz", timeout=60).returncode == 0 and maybe("node", REAL_NODE) is not None
    except subprocess.TimeoutExpired:
        return True


def bring_up() -> None:
    """`up --real-node`; one that fails is taken down (a half-up bed would stop every later suite)
    and named with the script's own words."""
    run = subprocess.run([TESTENV, "up", "--real-node"], capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        subprocess.run([TESTENV, "down"], capture_output=True, timeout=300)
        pytest.fail(f"`{TESTENV} up --real-node` failed (exit {run.returncode}); the bed is down again:\n{run.stderr[-6000:]}")


@pytest.fixture(scope="module")
def testbed() -> Iterator[None]:
    """The test bed with its real node, up (started here unless a usable one already was; then
    left as found), lifl's manifests installed, and KIngresses marked ready by the stand-in. A
    bed started here is checked, once down, for anything it left on the host."""
    if KUBECONFIG.exists() and not usable():
        print(f"the test bed at {STATE} is unusable (no API server, or no real node {REAL_NODE}): taking it down", file=sys.stderr)
        subprocess.run([TESTENV, "down"], check=True, capture_output=True, timeout=300)
    started = not KUBECONFIG.exists()
    if started:
        host_sysctls = sysctls()
        absent_host_dirs = [directory for directory in LIFL_HOST_DIRS.values() if not directory.exists()]
        bring_up()
    standin = None
    try:
        standin = Background("kingress", [sys.executable, str(ROOT / "tests" / "k8s" / "kingress_standin.py")])
        install_manifests()
        yield
    finally:
        if standin is not None:
            standin.stop()
        if started:
            subprocess.run([TESTENV, "down"], check=True, timeout=300)
    if started:
        assert not leftovers(), leftovers()
        assert sysctls() == host_sysctls
        assert not [d for d in absent_host_dirs if d.exists()], "the bed made this machine's own lifl directories"
