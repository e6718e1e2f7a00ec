"""lifl on a real Kubernetes control plane with real Knative Serving (scripts/k8s-testenv.sh):
the manifests install, a Knative Service of lifl's class becomes ready through lifl's operator,
load on an FL job grows and shrinks its tenant's aggregators, the real scheduler puts them on the
nodes BestFit chose, and a restarted operator converges. Root only (network namespaces); the
test bed's first build takes about 15 minutes (`make test` builds it first)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, wait_for
from k8s.bed import ROOT, SUITE_MARKS, Background, get, inside, kubectl, maybe
from lifl import format as fmt
from lifl.autoscaler import names

pytestmark = SUITE_MARKS

READY_TIMEOUT_S = 180.0  # bounds a failure only


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c["status"]
    return None


@pytest.fixture
def operator(testbed: None, redis_url: str) -> Iterator[Background]:
    op = Background("operator", [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
                                 "-m", "lifl.autoscaler.handlers"], {"LIFL_REDIS": redis_url})
    yield op
    op.stop()


def service(tenant: str, **annotations: str) -> str:
    """A tenant's aggregator Service of lifl's class, as manifests/examples has it."""
    text = (ROOT / "manifests" / "examples" / "aggregator-service.yaml").read_text()
    text = text.replace("acme", tenant)
    for key, value in annotations.items():
        text = text.replace("        autoscaling.knative.dev/class: hierarchy.lifl.dev\n",
                            f"        autoscaling.knative.dev/class: hierarchy.lifl.dev\n        {key}: \"{value}\"\n")
    return text


def revision_pa(svc: str) -> dict[str, Any]:
    revision = get("ksvc", svc)["status"]["latestCreatedRevisionName"]
    return get("podautoscaler", revision)


def ready_pa(svc: str) -> dict[str, Any] | None:
    """The Service's latest PA once it is ready (None before: no revision yet, or not ready)."""
    service = maybe("ksvc", svc)
    revision = ((service or {}).get("status") or {}).get("latestCreatedRevisionName")
    pa = maybe("podautoscaler", revision) if revision else None
    return pa if condition(pa, "Ready") == "True" else None


def pods_of(svc: str) -> list[dict[str, Any]]:
    return get("pods", "-l", f"serving.knative.dev/service={svc}")["items"]


def running(svc: str) -> list[dict[str, Any]] | None:
    """The Service's pods once there are as many as its Deployment asks for, all running."""
    pods = pods_of(svc)
    if pods and len(pods) == replicas(revision_pa(svc)) and all(p["status"].get("phase") == "Running" for p in pods):
        return pods
    return None


def replicas(pa: dict[str, Any]) -> int:
    return get("deployment", pa["spec"]["scaleTargetRef"]["name"])["spec"].get("replicas", 0)


# -- tests ------------------------------------------------------------------------------------------------
def test_the_manifests_install_and_apply_again_unchanged(testbed: None) -> None:
    again = kubectl("apply", "-k", str(ROOT / "manifests"))
    assert "created" not in again, again
    assert get("crd", "fljobs.lifl.dev")["spec"]["versions"][0]["subresources"] == {"status": {}}
    daemonset = get("daemonset", "lifl-node", "-n", "lifl-system")
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "NET_ADMIN", "CHOWN", "FOWNER", "SETUID", "SETGID"]}
    assert daemonset["spec"]["template"]["spec"]["hostIPC"] is True
    assert get("configmap", "config-features", "-n", "knative-serving")["data"]["kubernetes.podspec-affinity"] == "enabled"
    role = get("clusterrole", "lifl-operator")
    assert {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]} in role["rules"]
    # an FLJob the API server refuses by its schema never reaches the operator
    bad = inside("kubectl", "apply", "-f", "-", input=json.dumps({
        "apiVersion": "lifl.dev/v1alpha1", "kind": "FLJob", "metadata": {"name": "bad"}, "spec": {"goal": 0}}))
    assert bad.returncode != 0 and "spec.goal" in bad.stderr


def test_a_service_of_lifls_class_becomes_ready_through_the_operator(operator: Background) -> None:
    kubectl("apply", "-f", "-", stdin=service("ready1", **{names.MIN_SCALE_ANNOTATION: "1"}))
    wait_for(lambda: condition(maybe("ksvc", "ready1-aggregators"), "Ready") == "True", READY_TIMEOUT_S,
             0.5, "the Service to become Ready")
    pa = wait_for(lambda: ready_pa("ready1-aggregators"), READY_TIMEOUT_S, 0.5, "its PA ready")
    sks = get("sks", pa["metadata"]["name"])
    assert sks["metadata"]["ownerReferences"][0]["uid"] == pa["metadata"]["uid"]  # the operator's, owned by the PA
    assert sks["spec"]["mode"] == "Serve" and sks["spec"]["objectRef"]["name"] == pa["spec"]["scaleTargetRef"]["name"]
    status = pa["status"]
    assert status["serviceName"] == sks["status"]["serviceName"] and status["metricsServiceName"] == sks["status"]["privateServiceName"]
    assert [condition(pa, kind) for kind in ("Active", "ScaleTargetInitialized", "SKSReady")] == ["True"] * 3
    assert (status["desiredScale"], status["actualScale"], replicas(pa)) == (1, 1, 1)  # its min-scale: no plan, no demand
    assert status["observedGeneration"] == pa["metadata"]["generation"]


def test_with_no_demand_a_revision_goes_to_zero_after_its_initial_scale(operator: Background) -> None:
    kubectl("apply", "-f", "-", stdin=service("zero1"))
    wait_for(lambda: condition(maybe("ksvc", "zero1-aggregators"), "Ready") == "True", READY_TIMEOUT_S, 0.5, "Ready")
    wait_for(lambda: revision_pa("zero1-aggregators")["status"].get("desiredScale") == 0, READY_TIMEOUT_S, 0.5, "scale to zero")
    wait_for(lambda: not pods_of("zero1-aggregators"), READY_TIMEOUT_S, 0.5, "its pods to go")
    pa = revision_pa("zero1-aggregators")
    assert replicas(pa) == 0 and condition(pa, "ScaleTargetInitialized") == "True"
    assert condition(pa, "Active") == "False" and pa["status"]["actualScale"] == 0
    assert condition(get("ksvc", "zero1-aggregators"), "Ready") == "True"  # a revision at zero is still ready


def test_an_fljobs_namespace_annotations_set_its_tenants_quota(operator: Background, redis_url: str) -> None:
    from lifl.quotas import Quota
    from lifl.state import ClusterState

    kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "quota1", "annotations": {"lifl.dev/quota-jobs": "3", "lifl.dev/quota-shm-bytes": "64Mi"}}}))
    kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "lifl.dev/v1alpha1", "kind": "FLJob", "metadata": {"name": "quota1", "namespace": "quota1"},
        "spec": {"tenant": "quota1", "goal": 2}}))
    state = ClusterState(redis_url)
    wait_for(lambda: condition(maybe("fljob", "quota1", "-n", "quota1"), "Accepted") == "True", READY_TIMEOUT_S, 0.5,
             "the job accepted")
    assert state.quota("quota1") == Quota(jobs=3, shm_bytes=64 << 20)  # set before the job was created
    kubectl("annotate", "namespace", "quota1", "lifl.dev/quota-jobs=none", "--overwrite")
    wait_for(lambda: state.quota("quota1").jobs is None, READY_TIMEOUT_S, 0.5, "the changed annotation followed")
    inside("kubectl", "delete", "fljob", "quota1", "-n", "quota1", "--ignore-not-found", "--wait=false")


def _model() -> bytes:
    return fmt.encode({"w": np.zeros(64, np.float32)})


@contextlib.contextmanager
def fl_job(tenant: str, node_id: str, goal: int, redis_url: str, run_dir: Path) -> Iterator[Any]:
    """The tenant's Service ready, a real lifl node whose id is the kwok node it stands for (on
    the operator's Redis), and an accepted FLJob of the tenant's name with its model set: the
    node's gateway client."""
    from lifl.client import Gateway
    from lifl.node.supervisor import Node, NodeConfig

    kubectl("apply", "-f", "-", stdin=service(tenant))
    wait_for(lambda: condition(maybe("ksvc", f"{tenant}-aggregators"), "Ready") == "True", READY_TIMEOUT_S, 0.5, "Ready")
    node = Node(NodeConfig(node=node_id, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=run_dir,
                           data_dir=run_dir.parent / "data", shm_capacity=1 << 30, keep_warm=30))
    addresses = node.start()
    gw = Gateway(addresses.http, token=OPERATOR_TOKEN)
    try:
        kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "lifl.dev/v1alpha1", "kind": "FLJob", "metadata": {"name": tenant, "namespace": "default"},
            "spec": {"tenant": tenant, "goal": goal, "leafFanIn": 2}}))
        wait_for(lambda: condition(maybe("fljob", tenant), "Accepted") == "True", READY_TIMEOUT_S, 0.5, "the job accepted")
        gw.set_model(tenant, _model())
        yield gw
    finally:
        gw.close()
        node.stop()
        inside("kubectl", "delete", "fljob", tenant, "--ignore-not-found", "--wait=false")


@pytest.mark.timeout(900, func_only=True)  # the smoothed queue decays by 0.7 a period after the load stops
def test_load_grows_the_tenants_aggregators_on_the_bestfit_node_and_their_absence_shrinks_them_to_zero(
        operator: Background, redis_url: str, run_dir: Path) -> None:
    with fl_job("load1", "kwok2", 12, redis_url, run_dir) as gw:
        wait_for(lambda: not pods_of("load1-aggregators"), READY_TIMEOUT_S, 0.5, "no pods while there is no demand")
        # rising load: twelve clients are assigned to the node and have not sent their updates yet
        for i in range(12):
            assert gw.assignment("load1", client=f"c{i}")["node"] == "kwok2"
        grown = wait_for(lambda: replicas(revision_pa("load1-aggregators")) >= 2, READY_TIMEOUT_S, 0.5, "the hierarchy to grow")
        assert grown
        pods = wait_for(lambda: running("load1-aggregators"), READY_TIMEOUT_S, 0.5, "every pod running")
        assert {p["spec"]["nodeName"] for p in pods} == {"kwok2"}  # where BestFit put the load
        labelled = [n["metadata"]["name"] for n in get("nodes", "-l", f"{names.placement_label('load1')}=true")["items"]]
        assert labelled == ["kwok2"]
        wait_for(lambda: get("fljob", "load1")["status"].get("plan", {}).get("kwok2", 0) > 0, READY_TIMEOUT_S, 0.5,
                 "the job's plan reported")
        # falling load: the updates arrive, the round completes, and nothing is waiting
        for i in range(12):
            gw.push("load1", _model(), client=f"c{i}", samples=1, base_version=0)
        wait_for(lambda: gw.job("load1")["version"] == 1, READY_TIMEOUT_S, 0.5, "the round")
        wait_for(lambda: replicas(revision_pa("load1-aggregators")) == 0, 600, 0.5, "scale to zero")
        wait_for(lambda: not pods_of("load1-aggregators"), READY_TIMEOUT_S, 0.5, "the pods to go")
        wait_for(lambda: get("fljob", "load1")["status"].get("version") == 1, READY_TIMEOUT_S, 0.5, "the job's version reported")


def test_deleting_an_fljob_takes_its_tenants_aggregators_to_zero(operator: Background, redis_url: str, run_dir: Path) -> None:
    with fl_job("gone1", "kwok3", 6, redis_url, run_dir) as gw:
        for i in range(6):  # clients are training: the tenant wants aggregators
            gw.assignment("gone1", client=f"c{i}")
        wait_for(lambda: running("gone1-aggregators") and replicas(revision_pa("gone1-aggregators")) >= 1, READY_TIMEOUT_S, 0.5,
                 "aggregators for the waiting clients")
        # the job is deleted while its clients still train: nothing wants the aggregators any more
        kubectl("delete", "fljob", "gone1")
        wait_for(lambda: replicas(revision_pa("gone1-aggregators")) == 0, READY_TIMEOUT_S, 0.5, "scale to zero")
        wait_for(lambda: not pods_of("gone1-aggregators"), READY_TIMEOUT_S, 0.5, "the pods to go")


def test_a_restarted_operator_converges_with_no_duplicate_pods(operator: Background) -> None:
    kubectl("apply", "-f", "-", stdin=service("restart1", **{names.MIN_SCALE_ANNOTATION: "3"}))
    wait_for(lambda: condition(maybe("ksvc", "restart1-aggregators"), "Ready") == "True", READY_TIMEOUT_S, 0.5, "Ready")
    wait_for(lambda: len(pods_of("restart1-aggregators")) == 3, READY_TIMEOUT_S, 0.5, "min-scale pods")
    before = sorted(p["metadata"]["name"] for p in pods_of("restart1-aggregators"))
    operator.restart()
    # it finds everything as it should be: same SKS, same pods, nothing created again
    wait_for(lambda: "resuming" in operator.output().lower() or "restart1" in operator.output(), 60, 0.5, "the operator back")
    pa = revision_pa("restart1-aggregators")
    kubectl("annotate", "podautoscaler", pa["metadata"]["name"], "lifl.dev/poke=1", "--overwrite")  # an event after its restart
    wait_for(lambda: ready_pa("restart1-aggregators"), READY_TIMEOUT_S, 0.5, "the PA ready")
    after = sorted(p["metadata"]["name"] for p in pods_of("restart1-aggregators"))
    assert after == before
    assert len(get("sks", "-l", "serving.knative.dev/service=restart1-aggregators")["items"]) == 1


def test_a_new_revision_takes_over_and_the_old_one_goes_to_zero(operator: Background) -> None:
    kubectl("apply", "-f", "-", stdin=service("rev1", **{names.MIN_SCALE_ANNOTATION: "1"}))
    wait_for(lambda: ready_pa("rev1-aggregators"), READY_TIMEOUT_S, 0.5, "the first revision ready")
    first = revision_pa("rev1-aggregators")
    # a changed template is a new revision; the old one stops being routed to (Unreachable)
    kubectl("apply", "-f", "-", stdin=service("rev1", **{names.MIN_SCALE_ANNOTATION: "2"}))
    wait_for(lambda: revision_pa("rev1-aggregators")["metadata"]["name"] != first["metadata"]["name"], READY_TIMEOUT_S, 0.5,
             "a second revision")
    wait_for(lambda: ready_pa("rev1-aggregators"), READY_TIMEOUT_S, 0.5, "the second revision ready")
    old = wait_for(lambda: (pa := get("podautoscaler", first["metadata"]["name"]))["spec"].get("reachability") == "Unreachable" and pa,
                   READY_TIMEOUT_S, 0.5, "the old revision unreachable")
    wait_for(lambda: replicas(get("podautoscaler", old["metadata"]["name"])) == 0, READY_TIMEOUT_S, 0.5, "the old revision at zero")
    assert get("podautoscaler", old["metadata"]["name"])["status"]["desiredScale"] == 0  # despite its min-scale
