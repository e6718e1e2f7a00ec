"""Every name the operator reads or writes in Kubernetes, in one place."""

from __future__ import annotations

# lifl's PodAutoscaler class: Knative's own reconcilers leave PAs of any other class alone, and
# its webhook refuses class names ending in ``.knative.dev``.
CLASS = "hierarchy.lifl.dev"
CLASS_ANNOTATION = "autoscaling.knative.dev/class"
MIN_SCALE_ANNOTATION = "autoscaling.knative.dev/min-scale"
MAX_SCALE_ANNOTATION = "autoscaling.knative.dev/max-scale"
INITIAL_SCALE_ANNOTATION = "autoscaling.knative.dev/initial-scale"

# A Knative Service's label naming the lifl tenant whose aggregators it runs (Knative copies it
# to the Revision and its PA); without it, the Service's name is the tenant.
TENANT_LABEL = "lifl.dev/tenant"
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
