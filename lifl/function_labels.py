"""What an aggregator function's deployment declares to lifl on Kubernetes, whoever writes it (a
Knative Service, an OpenFaaS stack file that ``lifl deploy -f`` checks and sends) and whoever
reads it (the operator, ``lifl.autoscaler``): the label and environment naming the function's
tenant, and how many replicas its scale annotations or OpenFaaS CE labels allow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# A Knative Service's (or an OpenFaaS function's) label naming the lifl tenant whose aggregators
# it runs (Knative copies it to the Revision and its PA); without it, the Service's name is the tenant.
TENANT_LABEL = "lifl.dev/tenant"
TENANT_ENV = "LIFL_TENANT"  # the function shim attaches as this tenant

# OpenFaaS Community Edition (faas-netes) serves one namespace, the provider's default.
OPENFAAS_DEFAULT_NAMESPACE = "openfaas-fn"
OPENFAAS_MIN_SCALE_LABEL = "com.openfaas.scale.min"
OPENFAAS_MAX_SCALE_LABEL = "com.openfaas.scale.max"
# CE runs at most this many replicas of a function, and never zero: its gateway clamps scale
# requests to 1..5 and faas-netes scales a Deployment edited to 0 or more than 5 back into that range.
OPENFAAS_CE_MAX_REPLICAS = 5
OPENFAAS_CE_MIN_REPLICAS = 1

MAX_REPLICAS = 10_000  # the largest scale the operator sets, whatever the plan says


class InvalidAnnotation(ValueError):
    """A PA's scale annotation (or an OpenFaaS function's scale label) is not a count: the PA (or
    the function) is left at its current scale, and says why."""


@dataclass(frozen=True)
class ScaleBounds:
    min: int = 0
    max: int = 0  # 0: no bound
    initial: int = 1

    def clamp(self, n: int) -> int:
        n = max(n, self.min)
        return min(n, self.max or MAX_REPLICAS, MAX_REPLICAS)


def replica_count(annotations: Mapping[str, str], key: str, default: int) -> int:
    """The number of pods an annotation (or label) ``key`` says, ``default`` when it is absent."""
    raw = annotations.get(key)
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise InvalidAnnotation(f"{key} must be a whole number of pods, got {raw!r}") from None
    if not 0 <= value <= MAX_REPLICAS:
        raise InvalidAnnotation(f"{key} must be between 0 and {MAX_REPLICAS}, got {value}")
    return value


def openfaas_scale_bounds(labels: Mapping[str, str]) -> ScaleBounds:
    """A function's replicas as its ``com.openfaas.scale.min/max`` labels bound them, within what
    OpenFaaS CE runs (1 to 5; the labels' defaults are CE's own, 1 and 5)."""
    low = replica_count(labels, OPENFAAS_MIN_SCALE_LABEL, OPENFAAS_CE_MIN_REPLICAS)
    high = replica_count(labels, OPENFAAS_MAX_SCALE_LABEL, OPENFAAS_CE_MAX_REPLICAS)
    for key, value in ((OPENFAAS_MIN_SCALE_LABEL, low), (OPENFAAS_MAX_SCALE_LABEL, high)):
        if not OPENFAAS_CE_MIN_REPLICAS <= value <= OPENFAAS_CE_MAX_REPLICAS:
            raise InvalidAnnotation(f"{key} must be between {OPENFAAS_CE_MIN_REPLICAS} and {OPENFAAS_CE_MAX_REPLICAS} "
                                    f"(OpenFaaS CE runs that many replicas of a function, never zero), got {value}")
    if low > high:
        raise InvalidAnnotation(f"{OPENFAAS_MIN_SCALE_LABEL} ({low}) exceeds {OPENFAAS_MAX_SCALE_LABEL} ({high})")
    return ScaleBounds(low, high, low)
