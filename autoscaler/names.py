"""Every name the operator reads or writes in Kubernetes, in one place; those a function's own
deployment declares (its tenant, its OpenFaaS scale labels) are ``lifl.function_labels``'s."""

from __future__ import annotations

# lifl's PodAutoscaler class: Knative's own reconcilers leave PAs of any other class alone, and
# its webhook refuses class names ending in ``.knative.dev``.
CLASS = "hierarchy.lifl.dev"
CLASS_ANNOTATION = "autoscaling.knative.dev/class"
MIN_SCALE_ANNOTATION = "autoscaling.knative.dev/min-scale"
MAX_SCALE_ANNOTATION = "autoscaling.knative.dev/max-scale"
INITIAL_SCALE_ANNOTATION = "autoscaling.knative.dev/initial-scale"

SERVICE_LABEL = "serving.knative.dev/service"

# BestFit places a tenant's aggregators by moving this node label: a node carries
# ``aggregators.lifl.dev/<tenant>: "true"`` while the plan gives it that tenant's aggregators,
# and the tenant's Service template requires it (a static node affinity, set once).
PLACEMENT_LABEL_PREFIX = "aggregators.lifl.dev/"
# Which pods a scale-down removes first (the ReplicaSet controller honours it).
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

PA_GROUP, PA_VERSION, PA_PLURAL = "autoscaling.internal.knative.dev", "v1alpha1", "podautoscalers"
SKS_GROUP, SKS_VERSION, SKS_PLURAL = "networking.internal.knative.dev", "v1alpha1", "serverlessservices"
SKS_KIND = "ServerlessService"
JOB_GROUP, JOB_VERSION, JOB_PLURAL = "lifl.dev", "v1alpha1", "fljobs"
JOB_KIND = "FLJob"

REACHABLE, UNREACHABLE = "Reachable", "Unreachable"


def placement_label(tenant: str) -> str:
    return PLACEMENT_LABEL_PREFIX + tenant


# -- OpenFaaS Community Edition (faas-netes) ---------------------------------------------------------
# faas-netes makes one Deployment per function, named after it, in the functions namespace; it
# labels the Deployment and its pods ``faas_function: <name>`` and copies the function's labels
# (``lifl.dev/tenant`` among them) onto the pod template only (faas-netes pkg/handlers/deploy.go).
FAAS_FUNCTION_LABEL = "faas_function"
# CE serves one namespace, the provider's default (``lifl.function_labels.OPENFAAS_DEFAULT_NAMESPACE``, unless
# this variable names another); the operator touches function Deployments there only (whoever can write Deployments elsewhere must not get a tenant's uid and the host's IPC).
OPENFAAS_NAMESPACE_ENV = "LIFL_OPENFAAS_NAMESPACE"

# What a function pod needs of its node: the agent's sockets and the key channel's live in this
# directory of the node pod (its run dir), mounted at the same path in the function's pod.
RUN_DIR = "/run/lifl"
# The host directory behind it, if not RUN_DIR: the node DaemonSet's hostPath, which the operator
# mounts into function pods (the Kubernetes test bed keeps its real node's in the bed's own state).
HOST_RUN_DIR_ENV = "LIFL_HOST_RUN_DIR"
RUN_VOLUME = "lifl-run"
AGENT_SOCKET = RUN_DIR + "/functions.sock"
# A namespace's annotation granting it tenants (comma-separated): only there do pods labelled
# with a tenant get its identity and the node's IPC (a cluster admin's decision).
TENANTS_ANNOTATION = "lifl.dev/tenants"

# The operator's admission webhook (autoscaler/admission.py): where it listens, the Service the
# API server calls it through (in a cluster), and the MutatingWebhookConfiguration kopf keeps.
WEBHOOK_LISTEN_ENV = "LIFL_WEBHOOK_LISTEN"
WEBHOOK_SERVICE_ENV = "LIFL_WEBHOOK_SERVICE"
WEBHOOK_CONFIGURATION = "lifl.dev"
