"""What lifl's admission webhook gives a tenant's function pod (autoscaler.resources.function_pod_spec,
pure, table-tested) and the webhook server's own configuration (autoscaler.admission)."""

from __future__ import annotations

import copy
import ssl
from pathlib import Path
from typing import Any

import pytest

from lifl.autoscaler import admission
from lifl.autoscaler.resources import InvalidFunction, function_pod_spec, granted_tenants

UID = 610001
RUN_VOLUME = {"name": "lifl-run", "hostPath": {"path": "/run/lifl", "type": "Directory"}}
RUN_MOUNT = {"name": "lifl-run", "mountPath": "/run/lifl", "readOnly": True}
PLACED = {"key": "aggregators.lifl.dev/acme", "operator": "In", "values": ["true"]}


def knative_pod() -> dict[str, Any]:
    """A pod as Knative's revision Deployment makes it: the user container first, then queue-proxy."""
    return {
        "containers": [
            {"name": "user-container", "image": "dev.local/lifl/aggregator:0.1.0", "ports": [{"containerPort": 8080}],
             "env": [{"name": "PORT", "value": "8080"}]},
            {"name": "queue-proxy", "image": "dev.local/knative/queue:v0.42.2",
             "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True}},
        ],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [PLACED]}]}}},
        "volumes": [{"name": "kube-api-access", "projected": {"sources": []}}],
    }


def test_a_knative_pod_gets_shared_memory_the_agents_socket_and_the_tenants_identity() -> None:
    pod = knative_pod()
    before = copy.deepcopy(pod)
    spec = function_pod_spec(pod, "acme", UID)
    assert pod == before  # pure: the input is untouched
    assert spec["hostIPC"] is True
    assert spec["securityContext"] == {"runAsUser": UID, "runAsGroup": UID, "runAsNonRoot": True}
    assert spec["volumes"] == [before["volumes"][0], RUN_VOLUME]
    function, queue = spec["containers"]
    assert function["volumeMounts"] == [RUN_MOUNT]
    assert function["securityContext"] == {"runAsUser": UID, "runAsGroup": UID, "runAsNonRoot": True,
                                           "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert function["env"] == [{"name": "PORT", "value": "8080"}, {"name": "LIFL_TENANT", "value": "acme"}]
    assert queue == before["containers"][1]  # Knative's sidecar keeps its own settings
    assert spec["affinity"] == before["affinity"]  # already placed: nothing added
    assert function_pod_spec(spec, "acme", UID) == spec  # idempotent


@pytest.mark.parametrize("affinity,terms", [
    (None, [{"matchExpressions": [PLACED]}]),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}, PLACED]}]}}},
     [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}, PLACED]},
      {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}, PLACED]}]),
])
def test_every_node_affinity_term_requires_the_tenants_placement(affinity: dict | None, terms: list) -> None:
    pod = {"containers": [{"name": "f"}], **({"affinity": affinity} if affinity else {})}
    spec = function_pod_spec(pod, "acme", UID)
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == terms


@pytest.mark.parametrize("given", [
    {"env": [{"name": "LIFL_TENANT", "value": "mallory"}]},  # a pod cannot pick another tenant
    {"securityContext": {"runAsUser": 0, "privileged": False}},  # nor root
    {"securityContext": {"runAsUser": 1000, "capabilities": {"add": ["SYS_ADMIN"]}, "allowPrivilegeEscalation": True}},
    {"volumeMounts": [{"name": "lifl-run", "mountPath": "/run/lifl"}]},  # writable: made read-only
])
def test_what_a_pod_says_about_identity_and_the_socket_is_overridden(given: dict[str, Any]) -> None:
    spec = function_pod_spec({"containers": [{"name": "f", **given}],
                              "volumes": [RUN_VOLUME] if "volumeMounts" in given else []}, "acme", UID)
    function = spec["containers"][0]
    assert function["securityContext"]["runAsUser"] == UID and function["securityContext"]["runAsGroup"] == UID
    assert function["securityContext"]["allowPrivilegeEscalation"] is False
    assert function["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [e for e in function["env"] if e["name"] == "LIFL_TENANT"] == [{"name": "LIFL_TENANT", "value": "acme"}]
    assert function["volumeMounts"] == [RUN_MOUNT]


def test_the_run_dir_comes_from_where_the_node_keeps_it_on_its_hosts() -> None:
    """A node DaemonSet whose hostPath is not /run/lifl (the test bed's real node): the function's
    pod mounts that host directory, still at /run/lifl, where the shim looks for the agent."""
    host_run_dir = "/run/lifl-testenv/real1/host/run/lifl"
    spec = function_pod_spec(knative_pod(), "acme", UID, host_run_dir)
    assert spec["volumes"][-1] == {"name": "lifl-run", "hostPath": {"path": host_run_dir, "type": "Directory"}}
    assert spec["containers"][0]["volumeMounts"] == [RUN_MOUNT]
    with pytest.raises(InvalidFunction, match=f"is not the host's {host_run_dir}"):
        function_pod_spec(knative_pod() | {"volumes": [RUN_VOLUME]}, "acme", UID, host_run_dir)


@pytest.mark.parametrize("setting,error", [
    (None, None), ("/run/lifl-testenv/real1/host/run/lifl", None), ("run/lifl", "must be an absolute path"),
])
def test_the_host_run_dir_setting_is_checked(monkeypatch: pytest.MonkeyPatch, setting: str | None, error: str | None) -> None:
    if setting is None:
        monkeypatch.delenv("LIFL_HOST_RUN_DIR", raising=False)
    else:
        monkeypatch.setenv("LIFL_HOST_RUN_DIR", setting)
    if error is None:
        assert admission.host_run_dir() == (setting or "/run/lifl")
    else:
        with pytest.raises(ValueError, match=f"LIFL_HOST_RUN_DIR {error}"):
            admission.host_run_dir()


@pytest.mark.parametrize("pod,problem", [
    ({"containers": []}, "no container"),
    ({"containers": [{"name": "f"}], "volumes": [{"name": "lifl-run", "emptyDir": {}}]}, "is not the host's /run/lifl"),
    ({"containers": [{"name": "f", "volumeMounts": [{"name": "other", "mountPath": "/run/lifl"}]}]}, "mounts something else"),
])
def test_pods_lifl_cannot_serve_are_refused_with_the_reason(pod: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidFunction, match=problem):
        function_pod_spec(pod, "acme", UID)


@pytest.mark.parametrize("host", ["127.0.0.1", "lifl-operator.lifl-system.svc"])
def test_the_webhooks_certificate_is_valid_for_its_host(tmp_path: Path, host: str) -> None:
    cert, key = admission.self_signed(host, tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600
    context = ssl.create_default_context(cafile=str(cert))
    context.load_cert_chain(cert, key)  # the pair matches
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    assert host.encode() in der or bytes(int(p) for p in host.split(".")) in der


@pytest.mark.parametrize("listen,error", [
    ("0.0.0.0:9443", None), ("127.0.0.1:1", None), ("9443", "ADDR:PORT"), (":9443", "ADDR:PORT"),
    ("0.0.0.0:0", "ADDR:PORT"), ("0.0.0.0:65536", "ADDR:PORT"), ("0.0.0.0:https", "ADDR:PORT"),
])
def test_the_listen_address_is_checked(listen: str, error: str | None) -> None:
    if error is None:
        assert admission.parse_listen(listen)[1] == int(listen.rsplit(":", 1)[1])
    else:
        with pytest.raises(ValueError, match=error):
            admission.parse_listen(listen)


@pytest.mark.parametrize("service,error", [
    ("lifl-system/lifl-operator", None), ("lifl-operator", "NAMESPACE/NAME"), ("a/b/c", "NAMESPACE/NAME"), ("/x", "NAMESPACE/NAME"),
])
def test_the_webhooks_service_is_checked(service: str, error: str | None) -> None:
    if error is None:
        assert admission.parse_service(service) == ("lifl-system", "lifl-operator")
    else:
        with pytest.raises(ValueError, match=error):
            admission.parse_service(service)



@pytest.mark.parametrize("annotations,granted", [
    ({}, set()),
    ({"lifl.dev/tenants": "acme"}, {"acme"}),
    ({"lifl.dev/tenants": "acme, globex,initech"}, {"acme", "globex", "initech"}),
    ({"lifl.dev/tenants": "acme,,Not_A_Tenant,-x"}, {"acme"}),  # what is not a tenant name grants nothing
    ({"lifl.dev/tenant": "acme"}, set()),  # the pods' label, not the namespace's grant
])
def test_a_namespace_runs_the_tenants_it_is_granted(annotations: dict[str, str], granted: set[str]) -> None:
    assert granted_tenants(annotations) == granted
