"""A stand-in for a Knative networking layer, for the test bed only.

No Knative networking controller (net-kourier, net-contour, net-istio, net-gateway-api) can be
obtained here, and without one a KIngress never becomes ready, so neither does any Route or
Service. This marks every KIngress ready as a networking layer would once it had programmed
its load balancer, pointing at an in-cluster address that nothing serves. It routes no traffic:
lifl's aggregators are reached through lifl's agents, not through Knative's ingress.

Run inside the test bed: ``scripts/k8s-testenv.sh exec python tests/k8s/kingress_standin.py``.
"""

from __future__ import annotations

import datetime
import sys

from kubernetes import client, config, watch

GROUP, VERSION, PLURAL = "networking.internal.knative.dev", "v1alpha1", "ingresses"
DOMAIN = "kingress-standin.knative-serving.svc.cluster.local"


def ready_status(ingress: dict) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [{"type": kind, "status": "True", "lastTransitionTime": now}
                  for kind in ("LoadBalancerReady", "NetworkConfigured", "Ready")]
    balancer = {"ingress": [{"domainInternal": DOMAIN}]}
    return {"observedGeneration": ingress["metadata"].get("generation", 1), "conditions": conditions,
            "privateLoadBalancer": balancer, "publicLoadBalancer": balancer}


def is_ready(ingress: dict) -> bool:
    status = ingress.get("status") or {}
    return status.get("observedGeneration") == ingress["metadata"].get("generation", 1) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def main() -> None:
    config.load_kube_config()
    api = client.CustomObjectsApi()
    print("kingress stand-in: marking KIngresses ready", file=sys.stderr, flush=True)
    while True:
        for event in watch.Watch().stream(api.list_cluster_custom_object, GROUP, VERSION, PLURAL, timeout_seconds=60):
            ingress = event["object"]
            if event["type"] == "DELETED" or is_ready(ingress):
                continue
            meta = ingress["metadata"]
            api.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
                                                      {"status": ready_status(ingress)})


if __name__ == "__main__":
    main()
