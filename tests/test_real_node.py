"""The test bed's real node (scripts/k8s-testenv.sh up --real-node): a kubelet on containerd whose
pods are real containers of lifl's locally built images, reached as lifl's pods reach the host:
`kubectl logs` and `exec`, the host's POSIX shared memory through hostIPC, a unix socket through
a hostPath, and the pod's own IP from the bed's namespace. Root only."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_for
from k8s.bed import (
    LIFL_HOST_DIRS, REAL_NODE, REAL_NODE_LABEL, REAL_NODE_LIFL_DIRS, SUITE_MARKS, TESTENV, get, inside, kubectl,
)

pytestmark = SUITE_MARKS

IMAGE = "dev.local/lifl/lifl:0.1.0"  # imported by the bed from scripts/images.sh's archives
POD_CIDR = ipaddress.ip_network("10.88.0.0/16")  # the real node's CNI bridge
WAIT_S = 180  # bounds a failure only: a loaded machine may start a pod slowly


def pod(name: str, command: list[str], **spec: Any) -> str:
    """A pod of lifl's image pinned to the real node, as a manifest."""
    container = {"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": command}
    container.update(spec.pop("container", {}))
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeSelector": {REAL_NODE_LABEL: "true"}, "restartPolicy": "Never", "containers": [container], **spec}})


@contextlib.contextmanager
def running_pod(manifest: str) -> Iterator[str]:
    name = json.loads(manifest)["metadata"]["name"]
    kubectl("apply", "-f", "-", stdin=manifest)
    try:
        yield name
    finally:
        inside("kubectl", "delete", "pod", name, "--ignore-not-found", "--wait=false")


def pod_once(name: str, done: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """The pod once ``done`` holds for it, on the real node; if it ends otherwise, fails at once with its log."""
    def check() -> dict[str, Any] | None:
        pod = get("pod", name)
        if done(pod):
            return pod
        phase = pod["status"].get("phase")
        assert phase not in ("Succeeded", "Failed"), f"pod {name} ended {phase}: {inside('kubectl', 'logs', name).stdout}"
        return None

    pod = wait_for(check, WAIT_S, 0.5, f"pod {name} {what}")
    assert pod["spec"]["nodeName"] == REAL_NODE
    return pod


def succeeded(name: str) -> str:
    """Waits for the pod to complete successfully; its log."""
    pod_once(name, lambda pod: pod["status"].get("phase") == "Succeeded", "to succeed")
    return kubectl("logs", name)


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def python(code: str) -> list[str]:
    return ["python3", "-c", code]


@pytest.fixture(scope="module")
def server(testbed: None) -> Iterator[dict[str, Any]]:
    """A pod serving HTTP on its own IP (port 8000), ready."""
    token = secrets.token_hex(8)
    manifest = pod("server", ["sh", "-c", f"mkdir -p /srv && echo {token} > /srv/token && exec python3 -m http.server -d /srv 8000"],
                   container={"readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}})
    with running_pod(manifest) as name:
        yield {"pod": pod_once(name, ready, "to be ready"), "token": token}


def test_the_real_node_is_ready_on_containerd_with_its_label_and_no_taint(testbed: None) -> None:
    node = get("node", REAL_NODE)
    assert ready(node)
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["metadata"]["labels"][REAL_NODE_LABEL] == "true"
    assert not node["spec"].get("taints")
    assert {"type": "InternalIP", "address": "10.200.0.2"} in node["status"]["addresses"]


def test_a_pod_of_lifls_image_runs_to_completion_and_its_log_is_read(testbed: None) -> None:
    token = secrets.token_hex(8)
    with running_pod(pod("once", python(f"import lifl; print('done', {token!r}, lifl.__name__)"))) as name:
        assert succeeded(name).split() == ["done", token, "lifl"]


def test_exec_runs_a_command_in_a_running_pod(server: dict[str, Any]) -> None:
    name = server["pod"]["metadata"]["name"]
    assert kubectl("exec", name, "--", "cat", "/srv/token").strip() == server["token"]
    assert kubectl("exec", name, "--", "hostname").strip() == name


def test_a_pods_ip_on_the_bridge_is_reached_from_the_beds_namespace(server: dict[str, Any]) -> None:
    ip = server["pod"]["status"]["podIP"]
    assert ipaddress.ip_address(ip) in POD_CIDR
    fetch = inside(sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen('http://{ip}:8000/token', timeout=30).read().decode())")
    assert fetch.returncode == 0, fetch.stderr
    assert fetch.stdout.strip() == server["token"]


def test_a_host_ipc_pod_shares_the_hosts_posix_shared_memory(testbed: None) -> None:
    token = secrets.token_bytes(16)
    shm = shared_memory.SharedMemory(name=f"lifl-real-node-{secrets.token_hex(4)}", create=True, size=64)
    try:
        shm.buf[:16] = token
        # the pod reads the host's object and writes its answer (the bytes reversed) after them
        code = (f"f = open('/dev/shm/{shm.name}', 'r+b'); seen = f.read(16); f.seek(16); f.write(seen[::-1]); "
                f"f.close(); print(seen.hex())")
        with running_pod(pod("shm", python(code), hostIPC=True)) as name:
            assert succeeded(name).strip() == token.hex()
        assert bytes(shm.buf[16:32]) == token[::-1]
    finally:
        shm.close()
        shm.unlink()


def test_a_pod_reaches_a_unix_socket_the_host_serves_through_a_host_path(testbed: None) -> None:
    directory = Path(tempfile.mkdtemp(prefix="lifl-real-node-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "agent.sock"))
    listener.listen(1)
    listener.settimeout(WAIT_S)
    received: list[bytes] = []

    def serve() -> None:  # one connection: read the pod's line, answer it
        connection, _ = listener.accept()
        with connection:
            line = connection.makefile("rb").readline()
            received.append(line)
            connection.sendall(b"ack " + line)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    token = secrets.token_hex(8)
    code = ("import socket; s = socket.socket(socket.AF_UNIX); s.connect('/run/agent/agent.sock'); "
            f"s.sendall(b'{token}\\n'); print(s.makefile('rb').readline().decode().strip())")
    try:
        manifest = pod("unixsock", python(code), container={"volumeMounts": [{"name": "agent", "mountPath": "/run/agent"}]},
                       volumes=[{"name": "agent", "hostPath": {"path": str(directory), "type": "Directory"}}])
        with running_pod(manifest) as name:
            assert succeeded(name).strip() == f"ack {token}"
        thread.join(WAIT_S)
        assert received == [f"{token}\n".encode()]
    finally:
        listener.close()
        (directory / "agent.sock").unlink(missing_ok=True)
        directory.rmdir()


def test_lifls_node_pod_writes_into_the_beds_own_host_directories_not_the_machines(testbed: None) -> None:
    """The bed points lifl's node DaemonSet's host directories into its state (the fixture checks,
    once the bed it started is down, that they are gone and that /run/lifl and /var/lib/lifl were
    not made): a pod with the DaemonSet's volumes and mounts writes there, this machine's get nothing."""
    node_pod = get("daemonset", "lifl-node", "-n", "lifl-system")["spec"]["template"]["spec"]
    volumes = [v for v in node_pod["volumes"] if v["name"] in REAL_NODE_LIFL_DIRS]
    assert {v["name"]: v["hostPath"]["path"] for v in volumes} == {name: str(d) for name, d in REAL_NODE_LIFL_DIRS.items()}
    mounts = [m for m in node_pod["containers"][0]["volumeMounts"] if m["name"] in REAL_NODE_LIFL_DIRS]
    assert {m["mountPath"] for m in mounts} == {str(d) for d in LIFL_HOST_DIRS.values()}  # where lifl up writes in the pod
    token = secrets.token_hex(8)
    write = " && ".join(f"echo {token} > {m['mountPath']}/{token}" for m in mounts)
    try:
        with running_pod(pod("hostdirs", ["sh", "-c", write], container={"volumeMounts": mounts}, volumes=volumes)) as name:
            succeeded(name)
        assert {name: (d / token).read_text() for name, d in REAL_NODE_LIFL_DIRS.items()} == {
            name: f"{token}\n" for name in REAL_NODE_LIFL_DIRS}
        assert not [d / token for d in LIFL_HOST_DIRS.values() if (d / token).exists()]
    finally:
        for directory in REAL_NODE_LIFL_DIRS.values():
            (directory / token).unlink(missing_ok=True)


def test_up_refuses_an_unknown_option_and_a_bad_real_node_setting() -> None:
    """Checked before anything starts (and before root is needed)."""
    run = subprocess.run([TESTENV, "up", "--real-nodes"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "unknown option '--real-nodes'" in run.stderr
    run = subprocess.run([TESTENV, "up"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LIFL_TESTENV_REAL_NODE": "yes"})
    assert run.returncode != 0 and "LIFL_TESTENV_REAL_NODE must be 0 or 1, not 'yes'" in run.stderr
