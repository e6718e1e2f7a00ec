"""What a Service cannot say, given to lifl's function pods as they are created: the operator's
mutating admission webhook.

A tenant's aggregator pods need the node's POSIX shared memory (``hostIPC``), the node agent's
sockets (the host's /run/lifl) and the tenant's uid and gid (the agent checks the peer's, and
only the tenant's group may read its objects). Knative refuses all three in a Service (its
field masks drop hostIPC and hostPath volumes) and OpenFaaS cannot express them, so the
operator adds them to every pod labelled ``lifl.dev/tenant`` when it is created, whoever made it
(a Knative revision, faas-netes, a plain Deployment). Only in namespaces a cluster admin granted
to the tenant (annotated ``lifl.dev/tenants: <tenant>[,<tenant>...]``): anyone else who may
create pods gets a refusal, not a tenant's identity and the host's IPC.

The webhook runs when ``LIFL_WEBHOOK_LISTEN`` (``ADDR:PORT``) is set; in a cluster
``LIFL_WEBHOOK_SERVICE`` (``namespace/name``) names the Service in front of it. The operator
makes its own certificate at start (the webhook configuration carries it as the CA bundle), and
kopf keeps the ``MutatingWebhookConfiguration`` named ``lifl.dev`` up to date.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from lifl import function_labels
from lifl.autoscaler import names, resources
from lifl.autoscaler.kube import Kube
from lifl.jobs import TENANT_NAME
from lifl.state import ClusterState

CERT_DAYS = 365  # the webhook's own certificate; a restart makes a new one
log = logging.getLogger("lifl.autoscaler.admission")


def self_signed(host: str, directory: Path) -> tuple[Path, Path]:
    """A certificate and key for ``host`` (a DNS name or an IP address), valid for CERT_DAYS:
    the webhook's, and its own CA (the webhook configuration carries it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "webhook.crt", directory / "webhook.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def parse_listen(listen: str) -> tuple[str, int]:
    addr, _, port = listen.rpartition(":")
    if not addr or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"{names.WEBHOOK_LISTEN_ENV} must be ADDR:PORT, got {listen!r}")
    return addr, int(port)


def parse_service(service: str) -> tuple[str, str]:
    namespace, _, name = service.partition("/")
    if not namespace or not name or "/" in name:
        raise ValueError(f"{names.WEBHOOK_SERVICE_ENV} must be NAMESPACE/NAME, got {service!r}")
    return namespace, name


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's server, announced to the API server through a Service (in a cluster the API server
    reaches a webhook by Service, not by the pod's address)."""

    def __init__(self, namespace: str, service: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = {"namespace": namespace, "name": service, "port": 443}

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async for config in super().__call__(fn):
            yield {"service": dict(self.service), **({"caBundle": config["caBundle"]} if "caBundle" in config else {})}


def host_run_dir() -> str:
    """The host directory function pods mount as the node's run dir: the node DaemonSet's
    hostPath, ``LIFL_HOST_RUN_DIR`` if set (the manifests' /run/lifl otherwise)."""
    directory = os.environ.get(names.HOST_RUN_DIR_ENV) or names.RUN_DIR
    if not os.path.isabs(directory):
        raise ValueError(f"{names.HOST_RUN_DIR_ENV} must be an absolute path (the node DaemonSet's run dir "
                         f"on its hosts), got {directory!r}")
    return directory


def webhook_server(listen: str, service: str | None, directory: Path) -> kopf.WebhookServer:
    addr, port = parse_listen(listen)
    if service:
        namespace, name = parse_service(service)
        cert, key = self_signed(f"{name}.{namespace}.svc", directory)
        return ServiceWebhookServer(namespace, name, addr=addr, port=port, certfile=cert, pkeyfile=key, cafile=cert)
    cert, key = self_signed(addr, directory)
    return kopf.WebhookServer(addr=addr, port=port, host=addr, certfile=cert, pkeyfile=key, cafile=cert)


@kopf.on.startup()
def configure_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    listen = os.environ.get(names.WEBHOOK_LISTEN_ENV)
    if not listen:
        log.warning("%s is not set: lifl's function pods get no shared memory or identity from this operator "
                    "(run the webhook in one operator of the cluster)", names.WEBHOOK_LISTEN_ENV)
        return
    host_run_dir()  # a bad setting stops the operator here, not each pod's admission
    directory = Path(tempfile.mkdtemp(prefix="lifl-webhook-"))
    settings.admission.server = webhook_server(listen, os.environ.get(names.WEBHOOK_SERVICE_ENV), directory)
    settings.admission.managed = names.WEBHOOK_CONFIGURATION


def function_pod(body: kopf.Body, namespace: str | None, patch: kopf.Patch, kube: Kube | None,
                 state: ClusterState | None) -> None:
    """Give a tenant's function pod what it needs, if its namespace was granted to the tenant
    (``kube``: the operator's API client, None while it starts; ``state``: its Redis, if any)."""
    tenant = body.get("metadata", {}).get("labels", {}).get(function_labels.TENANT_LABEL, "")
    if not TENANT_NAME.fullmatch(tenant):
        raise kopf.AdmissionError(f"label {function_labels.TENANT_LABEL} must name a lifl tenant (1-31 lowercase letters, digits, "
                                  f"'-'), got {tenant!r}")
    if kube is None:
        raise kopf.AdmissionError("the operator is still starting")
    if tenant not in resources.granted_tenants(kube.namespace_annotations(namespace or "default")):
        raise kopf.AdmissionError(f"namespace {namespace} is not granted to tenant {tenant!r}: a cluster admin annotates it "
                                  f"{names.TENANTS_ANNOTATION}={tenant} (a comma-separated list) to let it run the tenant's "
                                  f"functions")
    if state is None:
        raise kopf.AdmissionError(f"the operator has no Redis (LIFL_REDIS) to look tenant {tenant!r}'s uid up in")
    try:
        desired = resources.function_pod_spec(body.get("spec") or {}, tenant, state.tenant_id(tenant), host_run_dir())
    except resources.InvalidFunction as e:
        raise kopf.AdmissionError(f"a function pod of tenant {tenant!r}: {e}") from None
    if desired != body.get("spec"):
        patch["spec"] = desired  # lists come whole: kopf turns the difference into a JSON patch
