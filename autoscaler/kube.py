"""The operator's reads and writes in Kubernetes: thin calls, no decisions (``resources`` makes
those). Writes are idempotent and made only when something differs."""

from __future__ import annotations

from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from lifl.autoscaler import names

NOT_FOUND = 404


def connect() -> client.ApiClient:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        api = api or connect()
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    # -- ServerlessServices and PodAutoscalers ------------------------------------------------------
    def _custom(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as e:
            if e.status == NOT_FOUND:
                return None
            raise

    def sks(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._custom(names.SKS_GROUP, names.SKS_VERSION, names.SKS_PLURAL, namespace, name)

    def create_sks(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        return self.custom.create_namespaced_custom_object(names.SKS_GROUP, names.SKS_VERSION, meta["namespace"], names.SKS_PLURAL, body)

    def set_sks_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(names.SKS_GROUP, names.SKS_VERSION, namespace, names.SKS_PLURAL, name,
                                                          {"spec": spec})

    def pa(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._custom(names.PA_GROUP, names.PA_VERSION, names.PA_PLURAL, namespace, name)

    def pas(self) -> list[dict[str, Any]]:
        return self.custom.list_cluster_custom_object(names.PA_GROUP, names.PA_VERSION, names.PA_PLURAL)["items"]

    def fljob_names(self) -> set[str]:
        items = self.custom.list_cluster_custom_object(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL)["items"]
        return {job["metadata"]["name"] for job in items if not job["metadata"].get("deletionTimestamp")}

    def patch_pa_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(names.PA_GROUP, names.PA_VERSION, namespace, names.PA_PLURAL, name,
                                                          {"status": status})

    # -- the scale target ---------------------------------------------------------------------------
    def scale(self, namespace: str, deployment: str) -> tuple[int, int] | None:
        """(replicas asked for, ready pods) of the revision's Deployment; None if it is gone."""
        try:
            d = self.apps.read_namespaced_deployment(deployment, namespace)
        except ApiException as e:
            if e.status == NOT_FOUND:
                return None
            raise
        return d.spec.replicas or 0, d.status.ready_replicas or 0

    def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(deployment, namespace, {"spec": {"replicas": replicas}})

    def pods(self, namespace: str, selector: dict[str, str]) -> list[client.V1Pod]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return self.core.list_namespaced_pod(namespace, label_selector=label_selector).items

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})

    # -- namespaces and nodes ------------------------------------------------------------------------
    def namespace_annotations(self, namespace: str) -> dict[str, str]:
        return dict(self.core.read_namespace(namespace).metadata.annotations or {})

    def node_labels(self) -> dict[str, dict[str, str]]:
        return {n.metadata.name: dict(n.metadata.labels or {}) for n in self.core.list_node().items}

    def label_node(self, node: str, labels: dict[str, str | None]) -> None:
        """Set (or, with None, remove) labels of a node."""
        self.core.patch_node(node, {"metadata": {"labels": labels}})

    # -- OpenFaaS functions (faas-netes' Deployments) -----------------------------------------------
    def labelled_deployments(self, namespace: str, label: str) -> list[dict[str, Any]]:
        """The Deployments of ``namespace`` that carry ``label``, as the API's JSON (as kopf gives bodies)."""
        items = self.apps.list_namespaced_deployment(namespace, label_selector=label).items
        return [self.apps.api_client.sanitize_for_serialization(d) for d in items]
