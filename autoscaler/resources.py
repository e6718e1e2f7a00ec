"""What the operator wants Kubernetes to hold, as pure functions of what it read.

Knative's reconciler habit: ``make_*`` builders, conditions set through helpers, no I/O; the
handlers in ``operator.py`` read, call these, and write only what differs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from lifl import function_labels
from lifl.autoscaler import names
from lifl.jobs import TENANT_NAME

ACTIVE, INITIALIZED, SKS_READY, READY = "Active", "ScaleTargetInitialized", "SKSReady", "Ready"
PA_CONDITIONS = (ACTIVE, INITIALIZED, SKS_READY)  # Ready is their conjunction (a living condition set)

Object = Mapping[str, Any]


def scale_bounds(pa: Object) -> function_labels.ScaleBounds:
    annotations = pa.get("metadata", {}).get("annotations") or {}
    bounds = function_labels.ScaleBounds(function_labels.replica_count(annotations, names.MIN_SCALE_ANNOTATION, 0),
                         function_labels.replica_count(annotations, names.MAX_SCALE_ANNOTATION, 0),
                         function_labels.replica_count(annotations, names.INITIAL_SCALE_ANNOTATION, 1))
    if bounds.max and bounds.min > bounds.max:
        raise function_labels.InvalidAnnotation(f"{names.MIN_SCALE_ANNOTATION} ({bounds.min}) exceeds {names.MAX_SCALE_ANNOTATION} ({bounds.max})")
    return bounds


def is_ours(pa: Object) -> bool:
    return (pa.get("metadata", {}).get("annotations") or {}).get(names.CLASS_ANNOTATION) == names.CLASS


def tenant_of(pa: Object) -> str:
    labels = pa.get("metadata", {}).get("labels") or {}
    return labels.get(function_labels.TENANT_LABEL) or labels.get(names.SERVICE_LABEL) or pa["metadata"]["name"]


def condition(status: Object, kind: str) -> Object | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def is_true(status: Object, kind: str) -> bool:
    c = condition(status, kind)
    return c is not None and c.get("status") == "True"


def desired_scale(pa: Object, planned: int, bounds: function_labels.ScaleBounds) -> int:
    """The revision's pods: none once it is unreachable (an old revision); its initial scale
    until it first reached it (Knative's rule for marking a revision ready); then the plan's
    count within min/max-scale (Knative gives a custom class no scale-from-zero: the plan's
    demand brings pods back)."""
    if pa.get("spec", {}).get("reachability") == names.UNREACHABLE:
        return 0
    if not is_true(pa.get("status") or {}, INITIALIZED):
        return bounds.clamp(max(bounds.initial, bounds.min))
    return bounds.clamp(planned)


def make_sks(pa: Object) -> dict[str, Any]:
    """The ServerlessService the operator owns for a PA: same name, Serve mode (pods are
    reached directly; lifl never routes through the activator)."""
    meta, spec = pa["metadata"], pa.get("spec", {})
    return {
        "apiVersion": f"{names.SKS_GROUP}/{names.SKS_VERSION}",
        "kind": names.SKS_KIND,
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [owner_reference(pa)],
        },
        "spec": {"mode": "Serve", "objectRef": dict(spec.get("scaleTargetRef") or {}),
                 "protocolType": spec.get("protocolType", "http1")},
    }


def spec_differs(have: Object, want: Object) -> bool:
    """Whether ``have``'s spec differs from ``want``'s in any field ``want`` sets."""
    spec = have.get("spec") or {}
    return any(spec.get(k) != v for k, v in want["spec"].items())


def owner_reference(owner: Object) -> dict[str, Any]:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def owned_by(obj: Object, owner: Object) -> bool:
    uid = owner["metadata"]["uid"]
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def set_condition(conditions: Sequence[Object], kind: str, status: str, now: str, reason: str = "",
                  message: str = "") -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; its transition time moves only if its status does."""
    out, previous = [], None
    for c in conditions:
        if c.get("type") == kind:
            previous = c
        else:
            out.append(dict(c))
    new: dict[str, Any] = {"type": kind, "status": status}
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    new["lastTransitionTime"] = previous["lastTransitionTime"] if previous and previous.get("status") == status \
        and previous.get("lastTransitionTime") else now
    out.append(new)
    return sorted(out, key=lambda c: c["type"])


def _ready(conditions: Sequence[Object], now: str) -> list[dict[str, Any]]:
    """Ready follows its dependents: False if any is False, True if all are, else Unknown."""
    states = {c["type"]: c for c in conditions}
    dependents = [states.get(kind) for kind in PA_CONDITIONS]
    failing = next((c for c in dependents if c is not None and c["status"] == "False"), None)
    if failing is not None:
        return set_condition(conditions, READY, "False", now, failing.get("reason", ""), failing.get("message", ""))
    pending = next((c for c in dependents if c is None or c["status"] != "True"), None)
    if pending is not None:
        return set_condition(conditions, READY, "Unknown", now, (pending or {}).get("reason", ""), (pending or {}).get("message", ""))
    return set_condition(conditions, READY, "True", now)


def pa_status(pa: Object, sks: Object | None, desired: int, actual: int, now: str,
              problem: str = "") -> dict[str, Any]:
    """The PA's status as the operator writes it: the SKS's service names, the scale it asked
    for and the ready pods it has, and the conditions Knative reads (Ready = Active ∧
    ScaleTargetInitialized ∧ SKSReady). ``problem``: why the PA cannot be served as asked."""
    old = pa.get("status") or {}
    conditions: list[dict[str, Any]] = [dict(c) for c in old.get("conditions") or []]
    sks_status = (sks or {}).get("status") or {}
    sks_ready = sks is not None and is_true(sks_status, READY)
    if sks_ready:
        conditions = set_condition(conditions, SKS_READY, "True", now)
    else:
        conditions = set_condition(conditions, SKS_READY, "Unknown", now, "NotReady", "SKS Services are not ready yet")
    # initialized once it first had the pods it asked for (its initial scale), as Knative's HPA class does
    bounds_reached = is_true(old, INITIALIZED) or (sks_ready and actual >= desired)
    conditions = set_condition(conditions, INITIALIZED, "True" if bounds_reached else "Unknown", now,
                               "" if bounds_reached else "Queued", "" if bounds_reached else "Requests to the target are being buffered as resources are provisioned.")
    if problem:
        conditions = set_condition(conditions, ACTIVE, "False", now, "InvalidScale", problem)
    elif desired == 0 and actual == 0:
        conditions = set_condition(conditions, ACTIVE, "False", now, "NoTraffic", "The lifl plan has no aggregators for this tenant.")
    elif actual > 0:
        conditions = set_condition(conditions, ACTIVE, "True", now)
    else:
        conditions = set_condition(conditions, ACTIVE, "Unknown", now, "Activating", f"Scaling to {desired} pods.")
    status: dict[str, Any] = {
        "observedGeneration": pa.get("metadata", {}).get("generation", 0),
        "serviceName": sks_status.get("serviceName", ""),
        "metricsServiceName": sks_status.get("privateServiceName", ""),
        "desiredScale": desired,
        "actualScale": actual,
        "conditions": _ready(conditions, now),
    }
    return status


def placement(desired: int, planned: Mapping[str, int], nodes: Sequence[str], labelled: set[str]) -> set[str]:
    """The nodes that should carry a tenant's placement label: those the plan gives its
    aggregators (BestFit: as few as it can); when the plan places none of the pods asked for
    (an initial or minimum scale ahead of any load), the nodes already labelled, else one."""
    if desired <= 0:
        return set()
    known = set(nodes)
    chosen = {node for node, count in planned.items() if count > 0 and node in known}
    if chosen:
        return chosen
    return (labelled & known) or ({min(known)} if known else set())


def label_patches(label: str, chosen: set[str], nodes: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str | None]]:
    """Per node, the label patch that makes ``chosen`` exactly the nodes carrying ``label``."""
    patches: dict[str, dict[str, str | None]] = {}
    for node, labels in nodes.items():
        has = labels.get(label) == "true"
        if node in chosen and not has:
            patches[node] = {label: "true"}
        elif has and node not in chosen:
            patches[node] = {label: None}
    return patches


KEEP_COST, DROP_COST = "100", "-100"


def deletion_costs(pods: Sequence[tuple[str, str, str | None]], chosen: set[str]) -> dict[str, str]:
    """For (pod, node, current cost) of a revision: the pod-deletion-cost each pod should have
    so that a scale-down removes the pods on nodes the plan left first (the warm pods it keeps
    are the ones the plan reuses). Only pods whose cost changes are returned."""
    out = {}
    for pod, node, current in pods:
        want = KEEP_COST if node in chosen else DROP_COST
        if current != want:
            out[pod] = want
    return out


# FLJob spec fields (Kubernetes' camelCase) -> lifl's job fields
JOB_FIELDS = {"tenant": "tenant", "goal": "goal", "leafFanIn": "leaf_fan_in", "maxUpdateBytes": "max_update_bytes",
              "maxInflight": "max_inflight", "roundDeadlineSeconds": "round_deadline_s", "minUpdates": "min_updates",
              "leaseTTLSeconds": "lease_ttl_s", "overSelection": "over_selection", "maxSamples": "max_samples",
              "strategy": "strategy", "fixedPoint": "fixed_point"}


def job_request(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """An FLJob's spec as the body of lifl's job API (which validates it); unknown fields are
    passed under their own names so that the API names them."""
    return {"job": name, **{JOB_FIELDS.get(k, k): v for k, v in spec.items()}}


def status_patch(pa: Object, status: Mapping[str, Any]) -> dict[str, Any] | None:
    """The status fields that differ from what the PA holds (None: nothing to write)."""
    old = pa.get("status") or {}
    changed = {k: v for k, v in status.items() if old.get(k) != v}
    return changed or None


# -- OpenFaaS functions: faas-netes' Deployments of lifl tenants --------------------------------------------
class InvalidFunction(ValueError):
    """A function pod (or faas-netes Deployment) lifl cannot serve as it is: the operator refuses
    or leaves it alone, and says why."""


def openfaas_tenant(deployment: Object) -> str | None:
    """The lifl tenant whose aggregators a faas-netes Deployment runs: its pod template's
    ``lifl.dev/tenant`` (faas-netes copies a function's labels there only). None: no lifl function."""
    labels = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
    tenant = labels.get(function_labels.TENANT_LABEL)
    if tenant is not None and not TENANT_NAME.fullmatch(tenant):
        raise InvalidFunction(f"label {function_labels.TENANT_LABEL} must name a lifl tenant (1-31 lowercase letters, digits, '-'), "
                              f"got {tenant!r}")
    return tenant


# -- function pods: what every tenant's aggregator pod gets at admission ---------------------------------
def granted_tenants(namespace_annotations: Mapping[str, str]) -> set[str]:
    """The tenants whose functions a namespace may run: its ``lifl.dev/tenants`` annotation, a
    comma-separated list a cluster admin sets (OpenFaaS CE runs every function in one namespace,
    so one namespace may serve several tenants)."""
    listed = namespace_annotations.get(names.TENANTS_ANNOTATION, "")
    return {t.strip() for t in listed.split(",") if TENANT_NAME.fullmatch(t.strip())}


def function_pod_spec(spec: Object, tenant: str, uid: int, host_run_dir: str = names.RUN_DIR) -> dict[str, Any]:
    """The pod spec a tenant's function pod runs with: ``spec`` plus what lifl's aggregators need
    of their node and a Knative Service or an OpenFaaS stack file cannot say (equal to ``spec``
    when it has it all):

    - ``hostIPC``: the node's POSIX shared memory, where the objects are;
    - the host's ``host_run_dir`` (the node DaemonSet's run dir) at /run/lifl, read-only, in the
      function's container (the first: Knative and faas-netes put it there): the agent's function
      socket and the key channel's sockets (connecting to a socket needs no write access to its
      file system);
    - the tenant's uid and gid, not root, on the pod and on the function's container (a
      container's user wins over the pod's): the agent checks the peer's uid, and only the
      tenant's group may read its objects; no privilege escalation and no capabilities;
    - ``LIFL_TENANT`` in the function's environment: the tenant the shim attaches as is the one
      its identity was given for;
    - the node affinity to the tenant's placement label, which the operator moves (BestFit), added
      to every term already there (terms are alternatives: each must require it).

    Raises InvalidFunction when lifl's volume name or mount path is taken by something else."""
    out = copy.deepcopy(dict(spec))
    containers = out.get("containers") or []
    if not containers:
        raise InvalidFunction("its pod has no container")
    identity = {"runAsUser": uid, "runAsGroup": uid, "runAsNonRoot": True}
    volume = {"name": names.RUN_VOLUME, "hostPath": {"path": host_run_dir, "type": "Directory"}}
    mount = {"name": names.RUN_VOLUME, "mountPath": names.RUN_DIR, "readOnly": True}
    expression = {"key": names.placement_label(tenant), "operator": "In", "values": ["true"]}

    out["hostIPC"] = True
    out["securityContext"] = {**(out.get("securityContext") or {}), **identity}
    volumes = out.setdefault("volumes", [])
    have_volume = next((v for v in volumes if v.get("name") == names.RUN_VOLUME), None)
    if have_volume is None:
        volumes.append(volume)
    elif have_volume != volume:
        raise InvalidFunction(f"its volume {names.RUN_VOLUME} is not the host's {host_run_dir}: {have_volume}")
    required = (out.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}))
    terms = required.setdefault("nodeSelectorTerms", [])
    for term in terms:
        if expression not in (term.get("matchExpressions") or []):
            term["matchExpressions"] = [*(term.get("matchExpressions") or []), expression]
    if not terms:
        terms.append({"matchExpressions": [expression]})

    function = containers[0]
    mounts = function.setdefault("volumeMounts", [])
    have_mount = next((m for m in mounts if m.get("mountPath") == names.RUN_DIR), None)
    if have_mount is None:
        mounts.append(mount)
    elif have_mount.get("name") != names.RUN_VOLUME:
        raise InvalidFunction(f"its container mounts something else at {names.RUN_DIR}: {have_mount}")
    else:
        have_mount["readOnly"] = True
    function["securityContext"] = {**(function.get("securityContext") or {}), **identity,
                                   "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    env = [e for e in function.get("env") or [] if e.get("name") != function_labels.TENANT_ENV]
    function["env"] = [*env, {"name": function_labels.TENANT_ENV, "value": tenant}]
    return out
