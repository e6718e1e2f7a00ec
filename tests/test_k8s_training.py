"""lifl on Kubernetes with real pods, end to end (scripts/k8s-testenv.sh with its real node
``real1``): `kubectl apply -k manifests/` runs lifl's node pod (gateway and agent, from the
locally built node image) on the real node; a tenant's aggregators run as real containers of the
function image, as a Knative Service of lifl's class and as plain pods; lifl's operator gives
each of them, as it is created, the node's shared memory, the agent's socket and the tenant's
identity (its admission webhook); they attach to the agent and aggregate; one round is checked
against float64 FedAvg, and the digits CNN trains to 90 % through the node pod.

The bed has no cluster DNS or Service proxy (no CoreDNS, no kube-proxy can be had here), so the
node pod, on the host network of the bed, reaches a redis-server the test runs on the bed's
loopback (lifl-config's redis-url), and the operator and Redis run as processes of the bed, as
in tests/test_kubernetes.py. Root only; the first build of the bed and images takes a while."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import OPERATOR_TOKEN, wait_for
from k8s.bed import REAL_NODE, REAL_NODE_LIFL_DIRS, ROOT, SUITE_MARKS, Background, get, inside, kubectl, maybe
from lifl import demo
from lifl import function_labels
from lifl.autoscaler import names

pytestmark = SUITE_MARKS

TENANT = demo.TENANT  # `lifl demo` trains as this tenant
NAMESPACE = TENANT  # granted to the tenant: its pods may get the tenant's identity
SERVICE = f"{TENANT}-aggregators"
PODS = f"{TENANT}-aggregator-pods"
REDIS = "redis://127.0.0.1:16379/0"  # on the bed's loopback, which the node pod's host network is
WEBHOOK = "127.0.0.1:9443"
# The node pod shares the bed's network (hostNetwork), where Knative's autoscaler holds :8080
HTTP_PORT = 18080
READY_TIMEOUT_S = 300.0  # bounds a failure only: a cold pod on a loaded machine starts in seconds


def node_address() -> str:
    addresses = get("node", REAL_NODE)["status"]["addresses"]
    return next(a["address"] for a in addresses if a["type"] == "InternalIP")


def node_pod() -> dict[str, Any] | None:
    pods = get("pods", "-n", "lifl-system", "-l", "app.kubernetes.io/name=lifl-node",
               "--field-selector", f"spec.nodeName={REAL_NODE}")["items"]
    return pods[0] if pods else None


def ready(pod: dict[str, Any] | None) -> bool:
    return bool(pod) and not pod["metadata"].get("deletionTimestamp") and pod["status"].get("phase") == "Running" and all(
        c.get("ready") for c in pod["status"].get("containerStatuses") or [{}])


def function_pods() -> list[dict[str, Any]]:
    return get("pods", "-n", NAMESPACE, "-l", f"{function_labels.TENANT_LABEL}={TENANT}")["items"]


def function_status(pod: dict[str, Any]) -> dict[str, Any]:
    """The shim's own status (GET / on its port), asked from inside its container."""
    container = pod["spec"]["containers"][0]["name"]
    out = kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "-c", container, "--", "python3", "-c",
                  "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/').read().decode())")
    return json.loads(out)


def example(name: str) -> str:
    """A manifests/examples file for the demo's tenant, in its namespace."""
    text = (ROOT / "manifests" / "examples" / name).read_text()
    return text.replace("acme", TENANT).replace("namespace: default", f"namespace: {NAMESPACE}")


def in_bed(*argv: str, timeout: float) -> str:
    run = inside("env", f"LIFL_OPERATOR_TOKEN={OPERATOR_TOKEN}", *argv, timeout=timeout)
    assert run.returncode == 0, f"{' '.join(argv)} failed:\n{run.stdout}\n{run.stderr}"
    return run.stdout


@pytest.fixture(scope="module")
def lifl_cluster(testbed: None) -> Iterator[str]:
    """lifl's node pod running on the real node, Redis and the operator (with its webhook) as
    processes of the bed, and the demo's tenant granted its namespace: the gateway's address."""
    redis = Background("redis", ["redis-server", "--port", REDIS.rsplit(":", 1)[1].split("/")[0], "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no"])
    operator = None
    original: dict[str, Any] = {}
    try:
        wait_for(lambda: inside("redis-cli", "-p", "16379", "ping").stdout.strip() == "PONG", 60, 0.2, "Redis")
        assert redis.proc.poll() is None, f"redis-server did not start (port taken?): {redis.output()}"
        wait_for(lambda: maybe("namespace", NAMESPACE) is None, READY_TIMEOUT_S, 0.5, "an earlier run's namespace gone")
        kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "lifl-config", "namespace": "lifl-system"},
            "data": {"redis-url": REDIS}}))
        kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "lifl-operator-token", "namespace": "lifl-system"},
            "stringData": {"token": OPERATOR_TOKEN}}))
        kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": NAMESPACE, "annotations": {names.TENANTS_ANNOTATION: TENANT}}}))
        operator = Background("operator", [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
                                           "-m", "lifl.autoscaler.handlers"],
                              {"LIFL_REDIS": REDIS, names.WEBHOOK_LISTEN_ENV: WEBHOOK,
                               names.HOST_RUN_DIR_ENV: str(REAL_NODE_LIFL_DIRS["run"])})  # where the bed keeps the node's
        wait_for(lambda: maybe("mutatingwebhookconfiguration", names.WEBHOOK_CONFIGURATION), READY_TIMEOUT_S, 0.5,
                 "the operator's webhook")
        # the bed keeps lifl's workloads on kwok nodes: this node pod runs on the real one
        original = get("daemonset", "lifl-node", "-n", "lifl-system")["spec"]["template"]["spec"]
        node = original["containers"][0]
        command = [arg.replace(":8080", f":{HTTP_PORT}") for arg in node["command"]]
        ports = [{**p, "containerPort": HTTP_PORT} if p["name"] == "http" else p for p in node["ports"]]
        kubectl("patch", "daemonset", "lifl-node", "-n", "lifl-system", "--type", "json", "-p", json.dumps([
            {"op": "replace", "path": "/spec/template/spec/nodeSelector", "value": {"kubernetes.io/hostname": REAL_NODE}},
            {"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": command},
            {"op": "replace", "path": "/spec/template/spec/containers/0/ports", "value": ports}]))
        kubectl("label", "node", REAL_NODE, f"{names.placement_label(TENANT)}=true", "--overwrite")
        wait_for(lambda: ready(node_pod()), READY_TIMEOUT_S, 0.5, "lifl's node pod ready on the real node")
        yield f"{node_address()}:{HTTP_PORT}"
    finally:
        if original:
            inside("kubectl", "patch", "daemonset", "lifl-node", "-n", "lifl-system", "--type", "json", "-p", json.dumps([
                {"op": "replace", "path": "/spec/template/spec/nodeSelector", "value": original["nodeSelector"]},
                {"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": original["containers"][0]["command"]},
                {"op": "replace", "path": "/spec/template/spec/containers/0/ports", "value": original["containers"][0]["ports"]}]))
        for kind, name in (("ksvc", SERVICE), ("deployment", PODS)):
            inside("kubectl", "delete", kind, name, "-n", NAMESPACE, "--ignore-not-found", "--wait=false")
        # Knative's pods drain for up to their revision's timeout: a next run waits for the namespace to go
        inside("kubectl", "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")
        inside("kubectl", "delete", "mutatingwebhookconfiguration", names.WEBHOOK_CONFIGURATION, "--ignore-not-found")
        inside("kubectl", "label", "node", REAL_NODE, f"{names.placement_label(TENANT)}-")
        if operator is not None:
            operator.stop()
        redis.stop()


def test_the_node_pod_runs_lifl_from_its_image_on_the_real_node(lifl_cluster: str) -> None:
    pod = node_pod()
    assert pod is not None and pod["spec"]["containers"][0]["image"] == "dev.local/lifl/lifl:0.1.0"
    assert pod["spec"]["hostIPC"] and pod["spec"]["hostNetwork"]
    health = in_bed("python3", "-c", f"import urllib.request; print(urllib.request.urlopen('http://{lifl_cluster}/healthz').status)",
                    timeout=60)
    assert health.strip() == "200"
    log = kubectl("logs", "-n", "lifl-system", pod["metadata"]["name"])
    assert "keys travel by" in log


def test_function_pods_get_the_nodes_memory_and_the_tenants_identity_and_attach(lifl_cluster: str) -> None:
    kubectl("apply", "-f", "-", stdin=example("aggregator-service.yaml").replace(
        '        autoscaling.knative.dev/max-scale: "64"\n',
        '        autoscaling.knative.dev/max-scale: "4"\n        autoscaling.knative.dev/min-scale: "1"\n'))
    kubectl("apply", "-f", "-", stdin=example("aggregator-pods.yaml").replace("replicas: 2", "replicas: 1"))
    try:
        pods = wait_for(lambda: (p := [x for x in function_pods() if ready(x)]) and len(p) >= 2 and p,
                        READY_TIMEOUT_S, 0.5, "the Knative pod and the plain pod ready (attached)")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{inside('kubectl', 'describe', 'pods', '-n', NAMESPACE).stdout}") from None
    kinds = {"knative" if "serving.knative.dev/revision" in p["metadata"]["labels"] else "plain" for p in pods}
    assert kinds == {"knative", "plain"}
    uids = set()
    for pod in pods:
        spec = pod["spec"]
        assert pod["spec"]["nodeName"] == REAL_NODE and spec["hostIPC"] is True
        function = spec["containers"][0]
        uids.add(function["securityContext"]["runAsUser"])
        assert {"name": names.RUN_VOLUME, "mountPath": names.RUN_DIR, "readOnly": True} in function["volumeMounts"]
        assert {"name": names.RUN_VOLUME, "hostPath": {"path": str(REAL_NODE_LIFL_DIRS["run"]), "type": "Directory"}} in spec["volumes"]
        status = function_status(pod)
        assert status["ready"] and status["node"] == REAL_NODE and status["tenant"] == TENANT
    (uid,) = uids
    assert uid >= 610000  # the tenant's, from Redis: the agent checked it when they attached

    # a namespace not granted to the tenant gets no pod of it
    refused = inside("kubectl", "run", "intruder", "-n", "default", "--image=dev.local/lifl/aggregator:0.1.0",
                     f"--labels={function_labels.TENANT_LABEL}={TENANT}", "--restart=Never")
    assert refused.returncode != 0 and "not granted to tenant" in refused.stderr, refused.stderr


def test_one_round_through_the_pods_is_float64_fedavg(lifl_cluster: str) -> None:
    wait_for(lambda: len([p for p in function_pods() if ready(p)]) >= 2, READY_TIMEOUT_S, 0.5, "the function pods")
    out = in_bed(sys.executable, str(ROOT / "tests" / "k8s" / "fedavg_round.py"), lifl_cluster, TENANT, "check", "6",
                 timeout=600)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["version"] == 1 and result["max_abs_error"] <= 1e-5, result


@pytest.mark.timeout(1200, func_only=True)
def test_the_digits_cnn_trains_to_90_percent_through_the_node_pod(lifl_cluster: str, tmp_path: Any) -> None:
    before = sum(function_status(p)["tasks"] for p in function_pods() if ready(p))
    out = in_bed(sys.executable, "-m", "lifl", "demo", "--gateway", lifl_cluster, "--workers", "2", "--max-minutes", "12",
                 "--results", str(tmp_path), "--json", timeout=1100)
    summary = json.loads(out.strip().splitlines()[-1])
    print("lifl demo --gateway (through the node pod):", json.dumps(summary))  # pytest -s shows the figures
    assert summary["reached_target"] and summary["final_accuracy"] >= 0.9, summary
    assert summary["aggregation_cpu_s"] is None  # the node's processes are in its pod: not the demo's to measure
    pods = [p for p in function_pods() if ready(p)]
    done = sum(function_status(p)["tasks"] for p in pods) - before
    assert done >= summary["rounds"] >= 1  # every round's aggregation ran in the function pods
    metrics = in_bed("python3", "-c", f"import urllib.request; print(urllib.request.urlopen('http://{lifl_cluster}/metrics').read().decode())",
                     timeout=60)
    created = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("lifl_aggregator_instances_created_total{")}
    assert created.get("attached", 0) >= 2 and created.get("cold_start", 0) == 0, created  # the node started none
