"""``lifl deploy -f stack.yml``: a stack file's functions through an OpenFaaS gateway's REST API.

What ``faas-cli deploy -f`` does, for lifl's aggregator functions on OpenFaaS Community Edition:

1. read the stack file (faas-cli's format: go-sdk's ``stack`` package) and check all of it before
   the first request, so a bad file changes nothing: every error names the function and field;
2. per function, build its FunctionDeployment and update it (``PUT /system/functions``); the
   gateway answers 404 for a function it does not have, and then it is created (``POST``), as
   faas-cli does and the gateway's API document allows;
3. scale it to its minimum (``POST /system/scale-function/{name}``); lifl's operator takes it from
   there (docs/openfaas.md).

The YAML is read as faas-cli's yaml.v3 reads it into go-sdk's types: every scalar is its own text
(``version: 1.0`` is "1.0", an environment value ``8080`` is "8080"), plain ``~``/``null``/empty
is null, ``<<`` merges, a key twice is an error. Unlike faas-cli, an unknown field is an error
(faas-cli drops it silently), and environment variables are not substituted (faas-cli's
``--envsubst``): a value that would be substituted is refused.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import ipaddress
import json
import os
import re
import socket
import sys
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lifl import function_labels
from lifl.jobs import TENANT_NAME

MAX_STACK_BYTES = 1 << 20  # a stack file, and each environment_file or template.yml it names
MAX_STACK_NODES = 100_000  # YAML nodes once aliases are expanded (ten aliases can make a billion)
MAX_STACK_DEPTH = 32  # nesting of YAML collections (a stack file needs four)
MAX_FUNCTIONS = 15  # OpenFaaS CE runs at most 15 functions (faas-netes' MaxFunctions)
REQUEST_TIMEOUT_S = 30.0  # each request, from connecting to the last byte of its answer
MAX_TIMEOUT_S = 600.0  # the largest --timeout
MAX_RESPONSE_BYTES = 64 << 10  # an answer's body (the deploy API's are a few words)
MAX_ERROR_CHARS = 300  # of a gateway's error body, shown
MAX_PASSWORD_CHARS = 4096  # read from standard input

DEFAULT_GATEWAY = "http://127.0.0.1:8080"  # faas-cli's
DEFAULT_USERNAME = "admin"  # OpenFaaS' basic-auth user
GATEWAY_ENV, PASSWORD_ENV = "OPENFAAS_URL", "OPENFAAS_PASSWORD"
PROVIDER_NAME = "openfaas"  # the only one faas-cli accepts
STACK_VERSIONS = ("1.0",)  # go-sdk's ValidSchemaVersions
TEMPLATES_DIR = "templates"  # lifl's function templates, next to the stack file
# Scaling labels only OpenFaaS Pro honours: faas-netes CE refuses a function that has them
# (com.openfaas.scale.zero only when "true"), so they are refused here before any request.
PRO_ONLY_LABELS = ("com.openfaas.scale.zero-duration", "com.openfaas.scale.target", "com.openfaas.scale.type")
PRO_ONLY_ZERO_LABEL = "com.openfaas.scale.zero"

# go-sdk's stack.Function: YAML key -> what it holds
TEXT, TEXT_LIST, TEXT_MAP, FLAG, RESOURCES = "text", "a list of text", "a map of text", "true or false", "memory and cpu"
FUNCTION_FIELDS = {
    "lang": TEXT, "handler": TEXT, "image": TEXT, "fprocess": TEXT, "environment": TEXT_MAP, "secrets": TEXT_LIST,
    "skip_build": FLAG, "constraints": TEXT_LIST, "environment_file": TEXT_LIST, "labels": TEXT_MAP, "limits": RESOURCES,
    "requests": RESOURCES, "readonly_root_filesystem": FLAG, "build_options": TEXT_LIST, "annotations": TEXT_MAP,
    "namespace": TEXT, "build_args": TEXT_MAP, "platforms": TEXT, "build_secrets": TEXT_MAP,
}
STACK_FIELDS = ("version", "provider", "functions", "configuration")
PROVIDER_FIELDS = ("name", "gateway")
CONFIGURATION_FIELDS = {"templates": "a list of {name, source}", "copy": TEXT_LIST}
TEMPLATE_SOURCE_FIELDS = ("name", "source")
RESOURCE_FIELDS = ("memory", "cpu")

YAML_NULLS = ("", "~", "null", "Null", "NULL")  # yaml.v3's, for plain scalars
# what yaml.v3 takes for a Go bool: YAML 1.2's literals, and YAML 1.1's for a typed bool field
YAML_TRUE = ("true", "True", "TRUE", "y", "Y", "yes", "Yes", "YES", "on", "On", "ON")
YAML_FALSE = ("false", "False", "FALSE", "n", "N", "no", "No", "NO", "off", "Off", "OFF")

# Kubernetes' syntax for what faas-netes makes of a function (it would refuse the rest with a 400
# or 500 after the request): names are DNS labels, keys qualified names.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX = 63
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MAX = 253
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE_MAX = 63
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?")
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]*")
SUBSTITUTION = re.compile(r"\$(\{|[A-Za-z_])")  # what faas-cli's envsubst would replace


class StackError(ValueError):
    """The stack file (or a file it names) cannot be deployed as it is: nothing was sent."""


class SettingError(ValueError):
    """A flag or environment variable of ``lifl deploy`` is wrong (the gateway, the password):
    nothing was sent."""


class GatewayError(RuntimeError):
    """The gateway refused or failed a request, or gave no usable answer in time."""


@dataclass(frozen=True)
class Function:
    """One function of a stack file, checked, as the gateway's FunctionDeployment will carry it."""

    name: str
    image: str
    namespace: str
    fprocess: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    requests: dict[str, str] = field(default_factory=dict)
    readonly_root_filesystem: bool = False
    scale: function_labels.ScaleBounds = function_labels.ScaleBounds(function_labels.OPENFAAS_CE_MIN_REPLICAS, function_labels.OPENFAAS_CE_MAX_REPLICAS,
                                     function_labels.OPENFAAS_CE_MIN_REPLICAS)


@dataclass(frozen=True)
class Stack:
    path: Path
    gateway: str  # the provider's, "" if none
    functions: list[Function]


# -- reading YAML as faas-cli does --------------------------------------------------------------------
def _read_bounded(path: Path, what: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STACK_BYTES + 1)
    except OSError as e:
        raise StackError(f"cannot read {what} {path}: {e.strerror}") from None
    if len(data) > MAX_STACK_BYTES:
        raise StackError(f"{what} {path} is larger than {MAX_STACK_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StackError(f"{what} {path} is not UTF-8 (byte {e.start})") from None


def load_yaml(text: str, source: str) -> Any:
    """One YAML document as faas-cli's yaml.v3 reads it into go-sdk's types (see the module's
    docstring), within MAX_STACK_NODES and MAX_STACK_DEPTH."""
    try:
        import yaml
    except ImportError:
        raise StackError("reading a stack file needs PyYAML (pip install pyyaml)") from None
    try:
        root = yaml.compose(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError as e:
        raise StackError(f"{source} is not YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise StackError(f"{source} nests deeper than {MAX_STACK_DEPTH} levels") from None
    if root is None:
        raise StackError(f"{source} is empty")
    budget = [MAX_STACK_NODES]

    def value(node: yaml.Node, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise StackError(f"{source} has more than {MAX_STACK_NODES} YAML nodes once its aliases are expanded")
        if isinstance(node, yaml.ScalarNode):
            return None if node.style is None and node.value in YAML_NULLS else node.value
        if depth >= MAX_STACK_DEPTH:
            raise StackError(f"{source} nests deeper than {MAX_STACK_DEPTH} levels")
        if isinstance(node, yaml.SequenceNode):
            return [value(item, depth + 1) for item in node.value]
        mapping: dict[str, Any] = {}
        merged: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise StackError(f"{source}, line {line}: a key must be text")
            if key_node.value == "<<" and key_node.style is None:  # a merge: the named mappings' keys not set here
                sources = value(value_node, depth + 1)
                for source_mapping in sources if isinstance(sources, list) else [sources]:
                    if not isinstance(source_mapping, dict):
                        raise StackError(f"{source}, line {line}: << must name a mapping or a list of mappings")
                    for k, v in source_mapping.items():
                        merged.setdefault(k, v)
                continue
            if key_node.value in mapping:
                raise StackError(f"{source}, line {line}: key {key_node.value!r} appears twice")
            mapping[key_node.value] = value(value_node, depth + 1)
        return {**merged, **mapping}

    return value(root, 0)


# -- checking a stack ---------------------------------------------------------------------------------
def _fields(value: Any, where: str, known: Any, why_unknown: str = "") -> dict[str, Any]:
    """``value`` as a mapping whose keys are all ``known``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StackError(f"{where} must be a mapping")
    for key in value:
        if key not in known:
            raise StackError(f"{where}: unknown field {key!r}{why_unknown} (known: {', '.join(known)})")
    return value


def _as(kind: str, value: Any, where: str) -> Any:
    """A field's value as its kind's Python type; None is the kind's empty value."""
    if kind == TEXT:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise StackError(f"{where} must be text")
        return value
    if kind == FLAG:
        if value is None:
            return False
        if value in YAML_TRUE or value in YAML_FALSE:
            return value in YAML_TRUE
        raise StackError(f"{where} must be true or false, got {value!r}")
    if kind == TEXT_LIST:
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise StackError(f"{where} must be a list of text")
        return list(value)
    if kind == TEXT_MAP:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(item is None or isinstance(item, str) for item in value.values()):
            raise StackError(f"{where} must be a mapping of names to text")
        return {k: v or "" for k, v in value.items()}
    resources = _fields(value, where, RESOURCE_FIELDS)  # RESOURCES
    out = {}
    for key, amount in resources.items():
        amount = _as(TEXT, amount, f"{where}.{key}")
        if amount:
            if not QUANTITY.fullmatch(amount):
                raise StackError(f"{where}.{key} must be a Kubernetes quantity such as 128Mi or 500m, got {amount!r}")
            out[key] = amount
    return out


def _substitutions(value: Any, where: str) -> None:
    """Refuse what faas-cli's --envsubst would replace with an environment variable."""
    if isinstance(value, str):
        if SUBSTITUTION.search(value):
            raise StackError(f"{where}: {value!r} names an environment variable, which faas-cli would substitute and "
                             "lifl deploy does not: substitute it first (e.g. with envsubst)")
    elif isinstance(value, dict):
        for k, v in value.items():
            _substitutions(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _substitutions(v, f"{where}[{i}]")


def _check_key(key: str, where: str) -> None:
    """A Kubernetes label or annotation key: [DNS subdomain/]qualified name."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > DNS_SUBDOMAIN_MAX or not DNS_SUBDOMAIN.fullmatch(prefix)):
        raise StackError(f"{where}: key {key!r} has a prefix that is not a DNS subdomain")
    if len(name) > LABEL_VALUE_MAX or not QUALIFIED_NAME.fullmatch(name):
        raise StackError(f"{where}: key {key!r} is not a Kubernetes qualified name (1-63 letters, digits, '-', '_', '.', "
                         "starting and ending with a letter or digit)")


def _check_function(name: str, raw: Any, stack_dir: Path) -> Function:
    where = f"functions.{name}"
    if len(name) > DNS_LABEL_MAX or not DNS_LABEL.fullmatch(name):
        raise StackError(f"{where}: a function's name must be a DNS label (1-{DNS_LABEL_MAX} lowercase letters, digits "
                         "and '-', starting and ending with a letter or digit)")
    spec = _fields(raw, where, FUNCTION_FIELDS, " (faas-cli would ignore it silently)")
    _substitutions(spec, where)
    values = {key: _as(kind, spec.get(key), f"{where}.{key}") for key, kind in FUNCTION_FIELDS.items()}

    if not values["image"]:
        raise StackError(f"{where}.image is required: the gateway deploys an image")
    if any(c.isspace() for c in values["image"]):
        raise StackError(f"{where}.image must be an image reference, got {values['image']!r}")
    namespace = values["namespace"] or function_labels.OPENFAAS_DEFAULT_NAMESPACE
    if len(namespace) > DNS_LABEL_MAX or not DNS_LABEL.fullmatch(namespace):
        raise StackError(f"{where}.namespace must be a Kubernetes namespace name (a DNS label), got {namespace!r}")

    environment = values["environment"]
    for i, env_file in enumerate(values["environment_file"]):  # later files win, over the stack's own (faas-cli's order)
        environment = {**environment, **_environment_file(stack_dir / env_file, f"{where}.environment_file[{i}]")}
    for key in environment:
        if not ENV_NAME.fullmatch(key):
            raise StackError(f"{where}.environment: {key!r} is not an environment variable name Kubernetes takes")

    labels = values["labels"]
    for key, value in labels.items():
        _check_key(key, f"{where}.labels")
        if value and (len(value) > LABEL_VALUE_MAX or not QUALIFIED_NAME.fullmatch(value)):
            raise StackError(f"{where}.labels.{key}: {value!r} is not a Kubernetes label value (at most {LABEL_VALUE_MAX} "
                             "letters, digits, '-', '_', '.', starting and ending with a letter or digit)")
    for key in values["annotations"]:
        _check_key(key, f"{where}.annotations")
    for key in PRO_ONLY_LABELS:
        if key in labels:
            raise StackError(f"{where}.labels.{key}: only OpenFaaS Pro has it; Community Edition refuses the function")
    if labels.get(PRO_ONLY_ZERO_LABEL) == "true":
        raise StackError(f"{where}.labels.{PRO_ONLY_ZERO_LABEL}: OpenFaaS CE cannot scale to zero")
    try:
        scale = function_labels.openfaas_scale_bounds(labels)
    except function_labels.InvalidAnnotation as e:
        raise StackError(f"{where}.labels: {e}") from None

    tenant = labels.get(function_labels.TENANT_LABEL)
    if tenant is not None:
        if not TENANT_NAME.fullmatch(tenant):
            raise StackError(f"{where}.labels.{function_labels.TENANT_LABEL} must name a lifl tenant (1-31 lowercase letters, "
                             f"digits, '-'), got {tenant!r}")
        if environment.get(function_labels.TENANT_ENV) != tenant:
            raise StackError(f"{where}.environment.{function_labels.TENANT_ENV} must be {tenant!r}, the tenant its label names: the "
                             "operator runs the pods as that tenant's user, and the agent takes only that tenant's "
                             f"instances from them (got {environment.get(function_labels.TENANT_ENV)!r})")

    fprocess = values["fprocess"] or _template_fprocess(values["lang"], stack_dir, where)
    return Function(name=name, image=values["image"], namespace=namespace, fprocess=fprocess, environment=environment,
                    secrets=values["secrets"], constraints=values["constraints"], labels=labels,
                    annotations=values["annotations"], limits=values["limits"], requests=values["requests"],
                    readonly_root_filesystem=values["readonly_root_filesystem"], scale=scale)


def _environment_file(path: Path, where: str) -> dict[str, str]:
    """An environment_file: a YAML file with one key, environment (faas-cli's EnvironmentFile)."""
    content = _fields(load_yaml(_read_bounded(path, "environment file"), str(path)), where, ("environment",))
    environment = _as(TEXT_MAP, content.get("environment"), f"{where} ({path}): environment")
    _substitutions(environment, f"{where} ({path}): environment")
    return environment


def _template_fprocess(lang: str, stack_dir: Path, where: str) -> str:
    """The process the watchdog starts, from the function's template (``fprocess`` of its
    template.yml), as faas-cli derives it; none for a Dockerfile function or one without a lang."""
    if not lang or lang.lower() == "dockerfile":
        return ""
    if not TEMPLATE_NAME.fullmatch(lang):
        raise StackError(f"{where}.lang must be a template name (letters, digits, '-', '_', '.'), got {lang!r}")
    path = stack_dir / TEMPLATES_DIR / lang / "template.yml"
    if not path.is_file():
        raise StackError(f"{where}.lang: there is no template {path} to take the function's fprocess from; "
                         "add the template or set fprocess")
    template = load_yaml(_read_bounded(path, "template"), str(path))
    if not isinstance(template, dict):
        raise StackError(f"template {path} must be a mapping")
    return _as(TEXT, template.get("fprocess"), f"template {path}: fprocess")


def check_stack(document: Any, stack_dir: Path) -> tuple[str, list[Function]]:
    """The provider's gateway ("" if none) and the functions of a loaded stack file, checked."""
    if not isinstance(document, dict):
        raise StackError("a stack file must be a mapping (version, provider, functions)")
    top = {k: v for k, v in document.items() if not k.startswith("x-")}  # x-*: room for YAML anchors, as in compose files
    _fields(top, "the stack file", STACK_FIELDS, " (faas-cli would ignore it silently)")
    version = top.get("version")
    if version is not None and version not in STACK_VERSIONS:
        raise StackError(f"version must be one of {', '.join(STACK_VERSIONS)}, got {version!r}")
    provider = _fields(top.get("provider"), "provider", PROVIDER_FIELDS)
    if provider.get("name") != PROVIDER_NAME:
        raise StackError(f"provider.name must be {PROVIDER_NAME!r}, got {provider.get('name')!r}")
    gateway = _as(TEXT, provider.get("gateway"), "provider.gateway")
    _substitutions(gateway, "provider.gateway")
    configuration = _fields(top.get("configuration"), "configuration", CONFIGURATION_FIELDS)
    _as(TEXT_LIST, configuration.get("copy"), "configuration.copy")
    templates = configuration.get("templates") or []
    if not isinstance(templates, list):
        raise StackError("configuration.templates must be a list of {name, source}")
    for i, source in enumerate(templates):
        for key, value in _fields(source, f"configuration.templates[{i}]", TEMPLATE_SOURCE_FIELDS).items():
            _as(TEXT, value, f"configuration.templates[{i}].{key}")
    functions = top.get("functions")
    if not isinstance(functions, dict) or not functions:
        raise StackError("functions must be a mapping of at least one function")
    if len(functions) > MAX_FUNCTIONS:
        raise StackError(f"the stack has {len(functions)} functions; OpenFaaS CE runs at most {MAX_FUNCTIONS}")
    return gateway, [_check_function(name, spec, stack_dir) for name, spec in functions.items()]


def read_stack(path: Path) -> Stack:
    gateway, functions = check_stack(load_yaml(_read_bounded(path, "stack file"), str(path)), path.parent)
    return Stack(path, gateway, functions)


def function_deployment(function: Function) -> dict[str, Any]:
    """The gateway's FunctionDeployment for a function (limits and requests only when set, as
    faas-cli sends them)."""
    body: dict[str, Any] = {
        "service": function.name, "image": function.image, "namespace": function.namespace,
        "envProcess": function.fprocess, "envVars": function.environment, "constraints": function.constraints,
        "secrets": function.secrets, "labels": function.labels, "annotations": function.annotations,
        "readOnlyRootFilesystem": function.readonly_root_filesystem,
    }
    if function.limits:
        body["limits"] = function.limits
    if function.requests:
        body["requests"] = function.requests
    return body


# -- the gateway ----------------------------------------------------------------------------------------
def gateway_url(flag: str | None, stack_gateway: str, environment: Mapping[str, str]) -> str:
    """The gateway as faas-cli picks it: --gateway; else the stack's provider.gateway unless it is
    faas-cli's default; else OPENFAAS_URL; else the stack's, or the default. Checked: http(s),
    a host, no credentials, query or fragment."""
    url = flag or (stack_gateway if stack_gateway != DEFAULT_GATEWAY else "") or environment.get(GATEWAY_ENV) \
        or stack_gateway or DEFAULT_GATEWAY
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url  # as faas-cli
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises for a port that is not a number
    except ValueError as e:
        raise SettingError(f"gateway URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingError(f"gateway URL {url!r} must be http:// or https:// and name a host")
    if parts.username is not None or parts.password is not None:
        raise SettingError(f"give the gateway's credentials with --username and --password-stdin or {PASSWORD_ENV}, "
                           "not in its URL")
    if parts.query or parts.fragment:
        raise SettingError(f"gateway URL {url!r} must not have a query or fragment")
    return url


def read_password(from_stdin: bool, stdin: IO[str], environment: Mapping[str, str]) -> str | None:
    """The gateway's basic-auth password: standard input (--password-stdin) or OPENFAAS_PASSWORD,
    not both; None: send no credentials."""
    if from_stdin and environment.get(PASSWORD_ENV):
        raise SettingError(f"give the password one way: --password-stdin or {PASSWORD_ENV}")
    if not from_stdin:
        return environment.get(PASSWORD_ENV) or None
    password = stdin.read(MAX_PASSWORD_CHARS + len("\r\n") + 1).rstrip("\r\n")  # the line's end is no part of it
    if len(password) > MAX_PASSWORD_CHARS:
        raise SettingError(f"the password on standard input is longer than {MAX_PASSWORD_CHARS} characters")
    if not password:
        raise SettingError("--password-stdin: standard input holds no password")
    return password


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes


@dataclass(frozen=True)
class Gateway:
    """An OpenFaaS gateway's REST API, through the standard library's HTTP client."""

    url: str
    username: str = DEFAULT_USERNAME
    password: str | None = None
    timeout_s: float = REQUEST_TIMEOUT_S
    max_response_bytes: int = MAX_RESPONSE_BYTES

    @property
    def sends_password_in_clear(self) -> bool:
        parts = urllib.parse.urlsplit(self.url)
        return self.password is not None and parts.scheme == "http" and not _is_loopback(parts.hostname or "")

    def request(self, method: str, path: str, body: Mapping[str, Any]) -> Answer:
        """One JSON request; the whole of it (connecting, sending, the answer's last byte) within
        timeout_s, and an answer of at most max_response_bytes."""
        parts = urllib.parse.urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname or "", parts.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "lifl-deploy"}
        if self.password is not None:
            credentials = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            headers["Authorization"] = f"Basic {credentials}"
        described = f"{method} {self.url}{path}"
        expired = threading.Event()
        sockets: list[socket.socket] = []  # the connection's (it lets go of it once the answer owns it)

        def cut_off() -> None:  # the socket's own timeout bounds each read, not the whole answer
            expired.set()
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout_s, cut_off)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            connection.request(method, parts.path + path, body=json.dumps(body).encode(), headers=headers)
            response = connection.getresponse()
            content = response.read(self.max_response_bytes + 1)
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):  # the deadline, or one step's share of it
                raise GatewayError(f"{described}: no complete answer within {self.timeout_s:g} s") from None
            raise GatewayError(f"{described}: {e or type(e).__name__}") from None
        finally:
            timer.cancel()
            connection.close()
        if expired.is_set():
            raise GatewayError(f"{described}: no complete answer within {self.timeout_s:g} s")
        if len(content) > self.max_response_bytes:
            raise GatewayError(f"{described}: the answer is larger than {self.max_response_bytes} bytes")
        return Answer(response.status, response.reason, content)

    def refused(self, method: str, path: str, answer: Answer) -> GatewayError:
        text = "".join(c if c.isprintable() else " " for c in answer.body.decode("utf-8", "replace"))
        text = " ".join(text.split())
        if len(text) > MAX_ERROR_CHARS:
            text = text[:MAX_ERROR_CHARS] + f"... ({len(answer.body)} bytes)"
        message = f"{method} {self.url}{path}: HTTP {answer.status} {answer.reason}" + (f": {text}" if text else "")
        if answer.status == http.HTTPStatus.UNAUTHORIZED:
            given = "no password was given" if self.password is None else f"the gateway refused user {self.username!r} and its password"
            message += (f" ({given}: give the gateway's basic-auth user with --username, default {DEFAULT_USERNAME}, and its "
                        f"password with --password-stdin or {PASSWORD_ENV})")
        return GatewayError(message)


DONE = (http.HTTPStatus.OK, http.HTTPStatus.CREATED, http.HTTPStatus.ACCEPTED)  # what faas-cli takes as done


def deploy(gateway: Gateway, function: Function) -> str:
    """Update the function, or create it if the gateway does not have it, then scale it to its
    minimum; "created" or "updated"."""
    body = function_deployment(function)
    path = "/system/functions"
    answer = gateway.request("PUT", path, body)
    outcome, method = "updated", "PUT"
    if answer.status == http.HTTPStatus.NOT_FOUND:
        answer = gateway.request("POST", path, body)
        outcome, method = "created", "POST"
    if answer.status not in DONE:
        raise gateway.refused(method, path, answer)
    path = f"/system/scale-function/{urllib.parse.quote(function.name, safe='')}"
    answer = gateway.request("POST", path, {"serviceName": function.name, "namespace": function.namespace,
                                            "replicas": function.scale.min})
    if answer.status not in DONE:
        raise gateway.refused("POST", path, answer)
    return outcome


# -- the command ------------------------------------------------------------------------------------------
def timeout_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--yaml", type=Path, default=Path("stack.yml"), metavar="STACK",
                   help="the stack file (default stack.yml); its templates are in templates/ next to it")
    p.add_argument("-g", "--gateway", metavar="URL",
                   help=f"the OpenFaaS gateway (default: the stack's provider.gateway, ${GATEWAY_ENV}, {DEFAULT_GATEWAY}, "
                        "in faas-cli's order)")
    p.add_argument("--username", default=DEFAULT_USERNAME, help=f"the gateway's basic-auth user (default {DEFAULT_USERNAME})")
    p.add_argument("--password-stdin", action="store_true",
                   help=f"read the gateway's password from standard input (or set ${PASSWORD_ENV}; without either, "
                        "no credentials are sent)")
    p.add_argument("--timeout", type=timeout_seconds, default=REQUEST_TIMEOUT_S, metavar="SECONDS",
                   help=f"each request's limit, to the last byte of its answer (default {REQUEST_TIMEOUT_S:g}, "
                        f"at most {MAX_TIMEOUT_S:g})")


def main(args: argparse.Namespace) -> int:
    deployed: list[str] = []
    try:
        stack = read_stack(args.yaml)
    except StackError as e:
        print(f"lifl deploy: {args.yaml}: {e}", file=sys.stderr)
        return 2
    try:
        gateway = Gateway(gateway_url(args.gateway, stack.gateway, os.environ), args.username,
                          read_password(args.password_stdin, sys.stdin, os.environ), args.timeout)
    except SettingError as e:
        print(f"lifl deploy: {e}", file=sys.stderr)
        return 2
    if gateway.sends_password_in_clear:
        print(f"lifl deploy: warning: the password goes to {gateway.url} unencrypted; use https", file=sys.stderr)
    for function in stack.functions:
        if function.constraints:
            print(f"lifl deploy: note: {function.name}: OpenFaaS CE ignores constraints; lifl's operator places "
                  "a tenant's aggregators with its node label", file=sys.stderr)
        try:
            outcome = deploy(gateway, function)
        except GatewayError as e:
            done = f" (deployed before it: {', '.join(deployed)})" if deployed else ""
            print(f"lifl deploy: {function.name}: {e}{done}", file=sys.stderr)
            return 1
        deployed.append(function.name)
        print(f"{function.name}: {outcome} at {gateway.url}, scaled to {function.scale.min}")
    return 0
