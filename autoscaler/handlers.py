"""lifl's Kubernetes operator: the autoscaler of Knative PodAutoscalers of lifl's class.

Run: ``kopf run --standalone -m lifl.autoscaler.handlers`` (``LIFL_REDIS``: the cluster's Redis,
where the agents publish their metrics and the jobs live).

For a PA of class ``hierarchy.lifl.dev`` Knative creates the revision's Deployment and nothing
else: this operator creates and owns its ServerlessService, scales the Deployment through its
scale subresource (from zero too: Knative gives a custom class no activator), places the pods
by moving the tenant's placement label between nodes (BestFit, as the planner decided), and
writes the PA's status. The numbers come from the same planner ``lifl up`` runs
(``lifl.control``), re-run every period by the operator's own control loop for the FLJobs that
exist; FLJobs put the jobs into Redis, and a timer on them reports their versions and plans.

A tenant's aggregators may also be an OpenFaaS CE function (``stack.yml``, docs/openfaas.md):
for faas-netes' Deployment of one, labelled ``lifl.dev/tenant`` in the functions namespace
(``LIFL_OPENFAAS_NAMESPACE``, default openfaas-fn), the operator scales and places it like a PA's
Deployment, within CE's 1 to 5 replicas. What its pods need of their node (and a stack file or a
Knative Service cannot say), every tenant's pod gets from the admission webhook (``admission``).

Everything is level-based: a handler reads what is there, computes what should be, and writes
the difference, so a restarted operator converges from what it finds. Handlers on objects
Knative owns are create/update/resume/event handlers only (a kopf timer or daemon would put a
blocking finalizer on them).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Collection, Mapping
from typing import Any

import kopf

from lifl import function_labels
from lifl.autoscaler import admission, names, resources
from lifl.autoscaler.kube import Kube
from lifl.cluster_types import NO_MODEL
from lifl.control.controller import ControlConfig, Controller
from lifl.errors import LiflError
from lifl.jobs import JobSpec
from lifl.quotas import Quota
from lifl.state import ClusterState

PLAN_PERIOD_S = 2.0  # how often the planner re-plans (the agents publish their metrics as often)
OPERATOR_NODE = "k8s-operator"  # the planner's name for itself
REVISION_LABEL = "serving.knative.dev/revision"

log = logging.getLogger("lifl.autoscaler")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Planner:
    """The control plane's plan, per tenant and node, made by the operator itself: the agents'
    controller (one node's, by lease) keeps its round duties and the nodes' own pre-warming.
    Without Redis there is no demand: PAs go to their initial scale and then to zero (or their
    min-scale)."""

    def __init__(self, state: ClusterState | None, period: float = PLAN_PERIOD_S) -> None:
        self.state = state
        self.controller = Controller(state, OPERATOR_NODE, ControlConfig(period=period)) if state else None
        self.warm: dict[str, dict[str, int]] = {}  # node -> tenant -> aggregators
        self._lock = threading.Lock()

    def tick(self, jobs: Collection[str]) -> None:
        """Re-plan for ``jobs``, the FLJobs that exist (a deleted one wants no aggregators)."""
        if self.controller is not None:
            warm = self.controller.plan(only=jobs)[0]
            with self._lock:
                self.warm = warm

    def nodes(self, tenant: str) -> dict[str, int]:
        """Aggregators the plan gives ``tenant`` on each node."""
        with self._lock:
            return {node: per_tenant[tenant] for node, per_tenant in self.warm.items() if per_tenant.get(tenant, 0) > 0}


def plan_and_scale(kube: Kube, planner: Planner) -> None:
    """One round of the control loop: re-plan for the FLJobs there are, and bring every PA of
    lifl's class to the plan (reading everything afresh: level-based)."""
    planner.tick(kube.fljob_names())
    for pa in kube.pas():
        if resources.is_ours(pa):
            reconcile_pa(pa, kube, planner)
    for deployment in kube.labelled_deployments(OPENFAAS_NAMESPACE, names.FAAS_FUNCTION_LABEL):
        if is_lifl_function(deployment):
            scale_function(deployment, kube, planner)


def control_loop(stop: threading.Event) -> None:
    """The operator's own loop, not tied to any object: Knative's objects must not carry a kopf
    timer (its finalizer), and a tenant whose FLJobs are all deleted must still go to zero."""
    while not stop.wait(PLAN_PERIOD_S):
        try:
            plan_and_scale(_kube(), PLANNER)
        except Exception:  # the API server or Redis may be away for a while: the next round retries
            log.exception("re-planning failed; trying again in %g s", PLAN_PERIOD_S)


KUBE: Kube | None = None
PLANNER = Planner(None)
STOP = threading.Event()  # ends the control loop


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global KUBE, PLANNER, OPENFAAS_NAMESPACE
    # kopf's bookkeeping goes into annotations of lifl's prefix (Knative keeps a PA's status
    # to its schema, and leaves annotations it does not own alone)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="lifl.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="lifl.dev")
    settings.posting.level = logging.WARNING
    KUBE = Kube()
    OPENFAAS_NAMESPACE = os.environ.get(names.OPENFAAS_NAMESPACE_ENV) or function_labels.OPENFAAS_DEFAULT_NAMESPACE
    url = os.environ.get("LIFL_REDIS")
    PLANNER = Planner(ClusterState(url) if url else None)
    if not url:
        log.warning("LIFL_REDIS is not set: no plans, so lifl-class PAs keep their initial and then minimum scale")
    STOP.clear()
    threading.Thread(target=control_loop, args=(STOP,), name="lifl-control-loop", daemon=True).start()


@kopf.on.cleanup()
def stop_control_loop(**_: Any) -> None:
    STOP.set()


def _kube() -> Kube:
    if KUBE is None:
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return KUBE


# -- PodAutoscalers of lifl's class -----------------------------------------------------------------
def reconcile_pa(pa: dict[str, Any], kube: Kube, planner: Planner) -> None:
    """Bring one PA's SKS, scale, placement and status to what they should be."""
    meta, spec = pa["metadata"], pa.get("spec", {})
    namespace, name = meta["namespace"], meta["name"]
    problem = ""
    try:
        bounds: function_labels.ScaleBounds | None = resources.scale_bounds(pa)
    except function_labels.InvalidAnnotation as e:
        bounds, problem = None, str(e)

    want = resources.make_sks(pa)
    sks = kube.sks(namespace, name)
    if sks is None:
        sks = kube.create_sks(want)
    elif not resources.owned_by(sks, pa):
        problem = problem or f"there is a ServerlessService {name} that this PodAutoscaler does not own"
        sks = None
    elif resources.spec_differs(sks, want):
        sks = kube.set_sks_spec(namespace, name, want["spec"])

    target = (spec.get("scaleTargetRef") or {}).get("name")
    scale = kube.scale(namespace, target) if target else None
    if scale is None:  # Knative has not made the Deployment yet: its creation brings us back
        return
    replicas, ready = scale
    tenant = resources.tenant_of(pa)
    planned = planner.nodes(tenant)
    desired = resources.desired_scale(pa, sum(planned.values()), bounds) if bounds is not None else replicas
    if desired != replicas:
        log.info("scaling %s/%s: %d -> %d pods", namespace, target, replicas, desired)
        kube.set_replicas(namespace, target, desired)
    if spec.get("reachability") != names.UNREACHABLE:
        place(kube, namespace, tenant, {REVISION_LABEL: meta.get("labels", {}).get(REVISION_LABEL, name)}, desired, planned)
    status = resources.pa_status(pa, sks, desired, ready, now(), problem)
    if resources.status_patch(pa, status) is not None:
        kube.patch_pa_status(namespace, name, status)


def place(kube: Kube, namespace: str, tenant: str, pods: dict[str, str], desired: int, planned: dict[str, int]) -> None:
    """Move the tenant's placement label onto the nodes the plan chose, and mark the pods on
    other nodes as the first to go (``pods``: the label selector of the tenant's pods)."""
    label = names.placement_label(tenant)
    nodes = kube.node_labels()
    labelled = {node for node, labels in nodes.items() if labels.get(label) == "true"}
    chosen = resources.placement(desired, planned, sorted(nodes), labelled)
    for node, patch in resources.label_patches(label, chosen, nodes).items():
        kube.label_node(node, patch)
    pods = [(p.metadata.name, p.spec.node_name or "", (p.metadata.annotations or {}).get(names.DELETION_COST_ANNOTATION))
            for p in kube.pods(namespace, pods)]
    for pod, cost in resources.deletion_costs(pods, chosen).items():
        kube.annotate_pod(namespace, pod, {names.DELETION_COST_ANNOTATION: cost})


OURS = {names.CLASS_ANNOTATION: names.CLASS}


@kopf.on.resume(names.PA_GROUP, names.PA_VERSION, names.PA_PLURAL, annotations=OURS)
@kopf.on.create(names.PA_GROUP, names.PA_VERSION, names.PA_PLURAL, annotations=OURS)
@kopf.on.update(names.PA_GROUP, names.PA_VERSION, names.PA_PLURAL, annotations=OURS)
def pa_changed(body: kopf.Body, **_: Any) -> None:
    reconcile_pa(dict(body), _kube(), PLANNER)


def _reconcile_named(namespace: str, name: str) -> None:
    kube = _kube()
    pa = kube.pa(namespace, name)
    if pa is not None and resources.is_ours(pa):
        reconcile_pa(pa, kube, PLANNER)


@kopf.on.event("apps", "v1", "deployments", labels={REVISION_LABEL: kopf.PRESENT})
def deployment_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A revision's pods came or went: its PA (named as the revision) reflects it."""
    if type == "DELETED":
        return
    _reconcile_named(body["metadata"]["namespace"], body["metadata"]["labels"][REVISION_LABEL])


@kopf.on.event(names.SKS_GROUP, names.SKS_VERSION, names.SKS_PLURAL)
def sks_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        return
    _reconcile_named(body["metadata"]["namespace"], body["metadata"]["name"])


# -- FLJobs: lifl's own objects -------------------------------------------------------------------------
def job_spec(name: str, spec: dict[str, Any]) -> JobSpec:
    """The lifl job an FLJob stands for, validated as the gateway validates one."""
    try:
        return JobSpec.from_request(resources.job_request(name, spec))
    except LiflError as e:
        raise kopf.PermanentError(f"FLJob {name}: {e}") from None


@kopf.on.resume(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL)
@kopf.on.create(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL)
def job_created(name: str, namespace: str, spec: dict[str, Any], patch: kopf.Patch, **_: Any) -> None:
    wanted = job_spec(name, dict(spec))
    state = PLANNER.state
    if state is None:
        raise kopf.TemporaryError("no Redis (LIFL_REDIS) to hold the job", delay=30)
    apply_namespace_quota(_kube(), state, namespace, wanted.tenant)
    try:
        existing = state.job(name).spec
    except LiflError:
        state.create_job(wanted)
        existing = wanted
    accepted = existing == wanted
    patch.status["conditions"] = resources.set_condition(
        [], "Accepted", "True" if accepted else "False", now(), "" if accepted else "SpecDiffers",
        "" if accepted else "a job of this name exists with another spec; lifl jobs cannot be changed once created")


def apply_namespace_quota(kube: Kube, state: ClusterState, namespace: str, tenant: str) -> None:
    """The tenant's quota as its FLJob's namespace annotates it (``lifl.dev/quota-*``,
    lifl.quotas), written when it differs; a namespace without such annotations leaves the
    tenant's quota as the API set it."""
    try:
        quota = Quota.from_annotations(kube.namespace_annotations(namespace))
    except LiflError as e:
        raise kopf.PermanentError(f"namespace {namespace}: {e}") from None
    if quota is not None and state.quota(tenant) != quota:
        state.set_quota(tenant, quota)


@kopf.on.update(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, field="spec")
def job_spec_changed(name: str, namespace: str, spec: dict[str, Any], patch: kopf.Patch, **_: Any) -> None:
    job_created(name=name, namespace=namespace, spec=spec, patch=patch)


@kopf.timer(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, interval=PLAN_PERIOD_S, initial_delay=0)
def job_status(name: str, namespace: str, spec: dict[str, Any], status: dict[str, Any], patch: kopf.Patch,
               **_: Any) -> None:
    """Report the job's version, round and plan (the control loop does the planning), and follow
    its namespace's quota annotations."""
    tenant = job_spec(name, dict(spec)).tenant
    state = PLANNER.state
    if state is None:
        return
    apply_namespace_quota(_kube(), state, namespace, tenant)
    try:
        job = state.job(name)
    except LiflError:
        return
    report = {"version": job.version if job.version != NO_MODEL else None, "round": job.round,
              "plan": PLANNER.nodes(tenant)}
    for key, value in report.items():
        if status.get(key) != value:
            patch.status[key] = value


# -- OpenFaaS functions: faas-netes' Deployments of lifl tenants ------------------------------------------
# A tenant's aggregators as an OpenFaaS CE function: faas-netes makes its Deployment from the stack
# file (its pods get the rest at admission), and the control loop scales it within CE's 1 to 5.
OPENFAAS_NAMESPACE = function_labels.OPENFAAS_DEFAULT_NAMESPACE  # configure() reads LIFL_OPENFAAS_NAMESPACE
_reported: dict[str, str] = {}  # function -> its standing problem, logged once


def _report(function: str, problem: str | None) -> None:
    """Log a function's standing problem once: the control loop meets it every period."""
    if problem is None:
        _reported.pop(function, None)
    elif _reported.get(function) != problem:
        _reported[function] = problem
        log.warning("OpenFaaS function %s: %s", function, problem)


def is_lifl_function(body: Mapping[str, Any], **_: Any) -> bool:
    """A faas-netes Deployment (labelled with its own name) of a lifl tenant, in the functions
    namespace: the only Deployments besides Knative's that the operator scales."""
    meta = body.get("metadata") or {}
    made_by_faas_netes = (meta.get("labels") or {}).get(names.FAAS_FUNCTION_LABEL) == meta.get("name")
    pod_labels = body.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
    return meta.get("namespace") == OPENFAAS_NAMESPACE and made_by_faas_netes and function_labels.TENANT_LABEL in pod_labels


def scale_function(deployment: Mapping[str, Any], kube: Kube, planner: Planner) -> None:
    """Bring one lifl function to the plan: its replicas (through the scale subresource, within
    its scale labels and CE's 1 to 5: CE has no scale to zero, so an idle tenant keeps one warm
    pod) and its tenant's placement."""
    meta = deployment["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    function = f"{namespace}/{name}"
    labels = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
    try:
        tenant = resources.openfaas_tenant(deployment)
        bounds = function_labels.openfaas_scale_bounds(labels)
    except (resources.InvalidFunction, function_labels.InvalidAnnotation) as e:
        _report(function, f"{e}; left at its current scale")
        return
    if tenant is None:
        return
    planned = planner.nodes(tenant)
    demand = sum(planned.values())
    desired = bounds.clamp(demand)
    _report(function, None if demand <= bounds.max else
            f"the plan wants {demand} aggregators for tenant {tenant}, the function runs at most {bounds.max} "
            f"(its {function_labels.OPENFAAS_MAX_SCALE_LABEL}; OpenFaaS CE allows at most {function_labels.OPENFAAS_CE_MAX_REPLICAS})")
    replicas = deployment.get("spec", {}).get("replicas") or 0
    if desired != replicas:
        log.info("scaling OpenFaaS function %s: %d -> %d pods", function, replicas, desired)
        kube.set_replicas(namespace, name, desired)
    place(kube, namespace, tenant, {names.FAAS_FUNCTION_LABEL: name}, desired, planned)


# kopf refuses to start with admission handlers and no server: the webhook's handler exists only
# where the webhook runs (one operator of the cluster).
if os.environ.get(names.WEBHOOK_LISTEN_ENV):
    @kopf.on.mutate("", "v1", "pods", operations={"CREATE"}, labels={function_labels.TENANT_LABEL: kopf.PRESENT},
                    id="function-pods")
    def function_pod(body: kopf.Body, namespace: str | None, patch: kopf.Patch, **_: Any) -> None:
        admission.function_pod(body, namespace, patch, KUBE, PLANNER.state)
