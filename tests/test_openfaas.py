"""lifl on OpenFaaS: the stack file against the stack schema, `lifl deploy` against a local
stand-in gateway that checks every request against OpenFaaS' published API document, and the
operator's handling of faas-netes' function Deployments (pure decisions, a real Redis).

No live OpenFaaS runs here (its Go modules are refused and its CE provider will not start
offline): the stand-in answers as the gateway and faas-netes do, as read in their sources
(openfaas/faas gateway/main.go and gateway/scaling/ranges.go; openfaas/faas-netes
pkg/handlers/{deploy,update,replica_updater,validate}.go), and it refuses any request the
document does not describe.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate as validate_api_document

from lifl import openfaas
from lifl import function_labels
from lifl.autoscaler import handlers, names, resources
from lifl.function_labels import ScaleBounds
from lifl.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
STACK = REPO / "stack.yml"
STACK_SCHEMA = json.loads((DATA / "openfaas-stack.schema.json").read_text())
API_DOCUMENT = yaml.safe_load((DATA / "openfaas-gateway.openapi.yml").read_text())
USER, PASSWORD = "admin", "s3cret-gateway-password"
FUNCTION = "acme-aggregators"


# -- the stack file and its schema ------------------------------------------------------------------------
def schema_problems(document: Any) -> list[str]:
    """The stack schema's objections to a loaded stack file, as 'where: what'."""
    validator = jsonschema.Draft202012Validator(STACK_SCHEMA)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(document))


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(STACK_SCHEMA)


def test_stack_yml_is_valid_by_the_stack_schema() -> None:
    assert schema_problems(openfaas.load_yaml(STACK.read_text(), str(STACK))) == []


def test_every_function_of_stack_yml_has_its_handler_and_its_template() -> None:
    document = openfaas.load_yaml(STACK.read_text(), str(STACK))
    for name, function in document["functions"].items():
        assert (REPO / function["handler"]).is_dir(), f"{name}: no handler directory {function['handler']}"
        assert (REPO / function["handler"] / "handler.py").is_file(), f"{name}: no handler.py in {function['handler']}"
        template = REPO / openfaas.TEMPLATES_DIR / function["lang"] / "template.yml"
        assert template.is_file(), f"{name}: no template {template}"
        assert openfaas.load_yaml(template.read_text(), str(template))["language"] == function["lang"]


def test_stack_yml_is_what_lifl_needs() -> None:
    stack = openfaas.read_stack(STACK)
    (function,) = stack.functions
    assert function.name == FUNCTION and function.image == "dev.local/lifl/aggregator:0.1.0"
    assert function.labels[function_labels.TENANT_LABEL] == function.environment["LIFL_TENANT"] == "acme"
    assert function.environment["LIFL_AGENT_SOCKET"] == names.AGENT_SOCKET
    assert function.scale == ScaleBounds(1, function_labels.OPENFAAS_CE_MAX_REPLICAS, 1)
    assert function.namespace == function_labels.OPENFAAS_DEFAULT_NAMESPACE and not function.constraints
    template = openfaas.load_yaml((REPO / "templates/lifl-aggregator/template.yml").read_text(), "template.yml")
    assert function.fprocess == template["fprocess"]  # taken from the template, as faas-cli does


def test_yaml_is_read_as_faas_cli_reads_it() -> None:
    text = """
version: 1.0
provider: {name: openfaas}
x-common: &common
  image: example/fn:1
  environment: {PORT: 8080, RATIO: 0.10, EMPTY: ~}
functions:
  fn:
    <<: *common
    readonly_root_filesystem: yes
    skip_build: off
    labels: {com.openfaas.scale.min: 2, quoted: "null"}
"""
    document = openfaas.load_yaml(text, "stack.yml")
    assert schema_problems(document) == []
    function = document["functions"]["fn"]
    assert document["version"] == "1.0" and function["image"] == "example/fn:1"  # scalars are their text
    assert function["environment"] == {"PORT": "8080", "RATIO": "0.10", "EMPTY": None}
    assert function["labels"] == {"com.openfaas.scale.min": "2", "quoted": "null"}  # only plain nulls are null
    _, (checked,) = openfaas.check_stack(document, REPO)
    assert checked.readonly_root_filesystem is True and checked.environment["EMPTY"] == ""
    assert checked.scale == ScaleBounds(2, 5, 2)


def valid_document() -> dict[str, Any]:
    """stack.yml, with the template's fprocess stated (so that a copy elsewhere needs no templates/)."""
    document = openfaas.load_yaml(STACK.read_text(), str(STACK))
    document["functions"][FUNCTION]["fprocess"] = "python3 index.py"
    return document


def function_of(document: dict[str, Any]) -> dict[str, Any]:
    return document["functions"][FUNCTION]


def edit(change: Callable[[dict[str, Any]], None]) -> str:
    document = valid_document()
    change(document)
    return yaml.safe_dump(document, sort_keys=False)


def set_in(*path_and_value: Any) -> Callable[[dict[str, Any]], None]:
    *path, value = path_and_value

    def change(document: dict[str, Any]) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return change


DELETE = object()
F = ("functions", FUNCTION)


def many_functions(count: int) -> Callable[[dict[str, Any]], None]:
    def change(document: dict[str, Any]) -> None:
        template = function_of(document)
        document["functions"] = {f"tenant{i}-aggregators": {**template, "labels": {}, "environment": {}} for i in range(count)}
    return change


def billion_laughs() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\nprovider: {name: openfaas}\nfunctions: {f: {image: x, environment: *a8}}\n"


# (case, stack file, the schema's objection or None (faas-cli's format allows it), lifl deploy's)
MALFORMED: list[tuple[str, str, str | None, str]] = [
    ("typo in a field", edit(set_in(*F, "limit", {"memory": "1Gi"})), "'limit' was unexpected",
     f"functions.{FUNCTION}: unknown field 'limit' (faas-cli would ignore it silently)"),
    ("typo at the top", edit(set_in("functons", {})), "'functons' does not match any of the regexes: '^x-'", "unknown field 'functons'"),
    ("another provider", edit(set_in("provider", "name", "faas")), "'openfaas' was expected",
     "provider.name must be 'openfaas', got 'faas'"),
    ("no provider", edit(set_in("provider", DELETE)), "'provider' is a required property", "provider.name must be 'openfaas'"),
    ("unknown version", edit(set_in("version", "2.0")), "'2.0' is not one of", "version must be one of 1.0, got '2.0'"),
    ("no functions", edit(set_in("functions", DELETE)), "'functions' is a required property",
     "functions must be a mapping of at least one function"),
    ("empty functions", edit(set_in("functions", {})), "should be non-empty", "functions must be a mapping of at least one"),
    ("16 functions", edit(many_functions(16)), "has too many properties", "the stack has 16 functions; OpenFaaS CE runs at most 15"),
    ("a name that is no DNS label", edit(lambda d: d["functions"].update({"Acme_Aggregators": d["functions"].pop(FUNCTION)})),
     "'Acme_Aggregators' does not match", "functions.Acme_Aggregators: a function's name must be a DNS label"),
    ("a name of 64 characters", edit(lambda d: d["functions"].update({"a" * 64: d["functions"].pop(FUNCTION)})),
     "is too long", "a function's name must be a DNS label (1-63"),
    ("no image", edit(set_in(*F, "image", DELETE)), "'image' is a required property",
     f"functions.{FUNCTION}.image is required"),
    ("an image with a space", edit(set_in(*F, "image", "dev.local/lifl aggregator")), "does not match '^\\\\S+$'",
     "image must be an image reference"),
    ("environment as a list", edit(set_in(*F, "environment", ["LIFL_TENANT=acme"])), "is not of type 'object', 'null'",
     f"functions.{FUNCTION}.environment must be a mapping of names to text"),
    ("an environment variable name Kubernetes refuses", edit(set_in(*F, "environment", "1 BAD", "x")),
     "'1 BAD' does not match", "'1 BAD' is not an environment variable name Kubernetes takes"),
    ("a label value Kubernetes refuses", edit(set_in(*F, "labels", "team", "not valid!")), "is not valid under any",
     f"functions.{FUNCTION}.labels.team: 'not valid!' is not a Kubernetes label value"),
    ("a label key Kubernetes refuses", edit(set_in(*F, "labels", "-team", "x")), "'-team' does not match",
     "key '-team' is not a Kubernetes qualified name"),
    ("an annotation key Kubernetes refuses", edit(set_in(*F, "annotations", "Bad_Prefix/x", "y")), "does not match",
     "key 'Bad_Prefix/x' has a prefix that is not a DNS subdomain"),
    ("memory that is no quantity", edit(set_in(*F, "limits", "memory", "lots")), "is not valid under any",
     f"functions.{FUNCTION}.limits.memory must be a Kubernetes quantity such as 128Mi or 500m, got 'lots'"),
    ("a resource faas-cli has not", edit(set_in(*F, "limits", "gpu", "1")), "'gpu' was unexpected", "unknown field 'gpu'"),
    ("a flag that is not one", edit(set_in(*F, "readonly_root_filesystem", "maybe")), "is not valid under any",
     "readonly_root_filesystem must be true or false, got 'maybe'"),
    ("secrets as a mapping", edit(set_in(*F, "secrets", {"a": "b"})), "is not of type 'array', 'null'",
     "secrets must be a list of text"),
    ("a namespace that is no DNS label", edit(set_in(*F, "namespace", "Other_NS")), "is not valid under any",
     "namespace must be a Kubernetes namespace name (a DNS label), got 'Other_NS'"),
    ("templates not a list", edit(set_in("configuration", {"templates": {"name": "x"}})), "is not of type 'array', 'null'",
     "configuration.templates must be a list of {name, source}"),
    ("not a mapping", "- a\n- b\n", "is not of type 'object'", "a stack file must be a mapping"),
    # what faas-cli's format allows and OpenFaaS CE or lifl do not
    ("more than CE's 5 replicas", edit(set_in(*F, "labels", function_labels.OPENFAAS_MAX_SCALE_LABEL, "7")), None,
     "com.openfaas.scale.max must be between 1 and 5 (OpenFaaS CE runs that many replicas of a function, never zero), got 7"),
    ("a minimum of zero", edit(set_in(*F, "labels", function_labels.OPENFAAS_MIN_SCALE_LABEL, "0")), None,
     "com.openfaas.scale.min must be between 1 and 5"),
    ("a minimum above the maximum", edit(lambda d: function_of(d)["labels"].update(
        {function_labels.OPENFAAS_MIN_SCALE_LABEL: "3", function_labels.OPENFAAS_MAX_SCALE_LABEL: "2"})), None,
     "com.openfaas.scale.min (3) exceeds com.openfaas.scale.max (2)"),
    ("a minimum that is no count", edit(set_in(*F, "labels", function_labels.OPENFAAS_MIN_SCALE_LABEL, "two")), None,
     "com.openfaas.scale.min must be a whole number of pods, got 'two'"),
    ("scale to zero", edit(set_in(*F, "labels", "com.openfaas.scale.zero", "true")), None, "OpenFaaS CE cannot scale to zero"),
    ("a Pro scaling label", edit(set_in(*F, "labels", "com.openfaas.scale.target", "50")), None,
     "com.openfaas.scale.target: only OpenFaaS Pro has it"),
    ("a tenant that is no lifl tenant", edit(set_in(*F, "labels", function_labels.TENANT_LABEL, "Acme")), None,
     "labels.lifl.dev/tenant must name a lifl tenant"),
    ("LIFL_TENANT is another tenant", edit(set_in(*F, "environment", "LIFL_TENANT", "globex")), None,
     f"functions.{FUNCTION}.environment.LIFL_TENANT must be 'acme', the tenant its label names"),
    ("an environment substitution", edit(set_in(*F, "image", "${IMAGE}")), None,
     f"functions.{FUNCTION}.image: '${{IMAGE}}' names an environment variable, which faas-cli would substitute"),
    ("a template that is not there", edit(set_in(*F, "fprocess", DELETE)), None, "there is no template"),
    ("a template name with a path", edit(lambda d: function_of(d).update({"lang": "../etc", "fprocess": None})), None,
     "lang must be a template name"),
    # YAML that does not load
    ("not YAML", "functions: [\n", None, "is not YAML"),
    ("a function twice", STACK.read_text() + f"\n  {FUNCTION}:\n    image: x\n", None, f"key '{FUNCTION}' appears twice"),
    ("two documents", "provider: {name: openfaas}\n---\nfunctions: {}\n", None, "expected a single document"),
    ("empty", "", None, "is empty"),
    ("a billion laughs", billion_laughs(), None, f"more than {openfaas.MAX_STACK_NODES} YAML nodes"),
    ("deep nesting", "a: " + "[" * 5000 + "]" * 5000 + "\n", None, f"nests deeper than {openfaas.MAX_STACK_DEPTH} levels"),
]


@pytest.mark.parametrize("case, text, schema_objection, deploy_objection", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_stack_files_are_refused_before_any_request(case: str, text: str, schema_objection: str | None,
                                                              deploy_objection: str, gateway: StandIn, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    if schema_objection is not None:
        problems = schema_problems(openfaas.load_yaml(text, case))
        assert any(schema_objection in p for p in problems), problems
    path = tmp_path / "stack.yml"
    path.write_text(text)
    assert run_deploy(path, gateway.url) == 2
    err = capsys.readouterr().err
    assert deploy_objection in err and err.startswith(f"lifl deploy: {path}: ")
    assert gateway.requests == []


def test_the_stack_file_size_limit(gateway: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = STACK.read_text()
    path = tmp_path / "stack.yml"
    at_limit = text + "#" * (openfaas.MAX_STACK_BYTES - len(text.encode()) - 1) + "\n"
    assert len(at_limit.encode()) == openfaas.MAX_STACK_BYTES
    path.write_text(at_limit)
    (tmp_path / "templates").symlink_to(REPO / "templates")
    assert [f.name for f in openfaas.read_stack(path).functions] == [FUNCTION]
    path.write_text(at_limit + "\n")
    assert run_deploy(path, gateway.url) == 2
    assert f"larger than {openfaas.MAX_STACK_BYTES} bytes" in capsys.readouterr().err and gateway.requests == []


def test_the_node_limit_is_exact() -> None:
    # nodes: the mapping, the list, and its items (keys are not counted)
    items = openfaas.MAX_STACK_NODES - 2
    assert len(openfaas.load_yaml("a: [" + ", ".join(["x"] * items) + "]", "big")["a"]) == items
    with pytest.raises(openfaas.StackError, match=f"more than {openfaas.MAX_STACK_NODES} YAML nodes"):
        openfaas.load_yaml("a: [" + ", ".join(["x"] * (items + 1)) + "]", "big")


def test_the_depth_limit_is_exact() -> None:
    depth = openfaas.MAX_STACK_DEPTH
    assert openfaas.load_yaml("[" * depth + "]" * depth, "deep") is not None
    with pytest.raises(openfaas.StackError, match=f"nests deeper than {depth} levels"):
        openfaas.load_yaml("[" * (depth + 1) + "]" * (depth + 1), "deep")


def test_fifteen_functions_are_the_most(tmp_path: Path) -> None:
    path = tmp_path / "stack.yml"
    path.write_text(edit(many_functions(openfaas.MAX_FUNCTIONS)))
    assert len(openfaas.read_stack(path).functions) == openfaas.MAX_FUNCTIONS


def test_function_names_of_63_characters_are_the_longest(tmp_path: Path) -> None:
    path = tmp_path / "stack.yml"
    path.write_text(edit(lambda d: d["functions"].update({"a" * 63: d["functions"].pop(FUNCTION)})))
    assert [f.name for f in openfaas.read_stack(path).functions] == ["a" * 63]


def test_environment_files_override_the_stack_in_order(tmp_path: Path) -> None:
    (tmp_path / "base.yml").write_text("environment: {A: from-base, B: from-base}\n")
    (tmp_path / "override.yml").write_text("environment: {B: from-override}\n")
    path = tmp_path / "stack.yml"
    path.write_text(edit(lambda d: function_of(d).update({"environment_file": ["base.yml", "override.yml"],
                                                           "environment": {"LIFL_TENANT": "acme", "A": "own"}})))
    (function,) = openfaas.read_stack(path).functions
    assert function.environment == {"LIFL_TENANT": "acme", "A": "from-base", "B": "from-override"}
    (tmp_path / "override.yml").write_text("environment: {B: from-override}\nextra: 1\n")
    with pytest.raises(openfaas.StackError, match=r"environment_file\[1\]: unknown field 'extra'"):
        openfaas.read_stack(path)


# -- the gateway's API document, and a stand-in gateway that holds every request to it --------------------
def test_the_api_document_is_valid_openapi() -> None:
    validate_api_document(API_DOCUMENT)


def closed(schema: Any) -> Any:
    """The schema with every object schema that lists its properties closed to others: the
    gateway's Go decoder ignores a field it does not know, so a misspelt one would pass silently."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@dataclass
class Fault:
    """What the stand-in does instead of answering one request (after checking it)."""

    status: int = 0  # answer this status (with body) instead
    body: bytes = b""
    stall: bool = False  # answer nothing until the test ends
    trickle: bool = False  # answer headers, then one byte of body every TRICKLE_S until the test ends


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


STALL_BOUND_S = 120.0  # a stalled answer ends by then even if a test forgets to release it
TRICKLE_S = 0.05
MAX_REQUEST_BYTES = 1 << 20
CE_DEFAULT_NAMESPACE = "openfaas-fn"
CE_MAX_FUNCTIONS = 15


class StandIn:
    """A local stand-in for an OpenFaaS CE gateway with faas-netes behind it: a real HTTP server on
    127.0.0.1. Every request is checked against the API document (path, method, parameters,
    content type, body schema; bodies closed to undeclared fields) and against the gateway's
    basic auth (it decorates every /system route with it); a request the document does not
    describe is answered 400 and recorded in ``violations``, which the fixture requires empty."""

    def __init__(self, document: dict[str, Any], username: str, password: str) -> None:
        self.document = document
        self.components = closed(document.get("components", {}))
        self.credentials = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        templated = sorted(document["paths"], key=lambda p: "{" in p)  # concrete paths match first (OpenAPI)
        self.routes = [(re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(p)) + "$"), p) for p in templated]
        self.requests: list[Recorded] = []
        self.violations: list[str] = []
        self.functions: dict[str, dict[str, Any]] = {}  # faas-netes' Deployments, by function name
        self.replicas: dict[str, int] = {}
        self.faults: dict[tuple[str, str], Fault] = {}
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="openfaas-stand-in", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=STALL_BOUND_S)

    def fault(self, method: str, path: str, fault: Fault) -> None:
        self.faults[(method, path)] = fault

    def paths(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    # -- the document -----------------------------------------------------------------------------------
    def check(self, method: str, target: str, headers: dict[str, str], raw: bytes) -> tuple[str, dict[str, str], Any, list[str]]:
        """(path template, path parameters, JSON body, what breaks the document)."""
        parts = urllib.parse.urlsplit(target)
        match = next(((regex.match(parts.path), template) for regex, template in self.routes if regex.match(parts.path)), None)
        if match is None:
            return "", {}, None, [f"{parts.path}: no such path in the API document"]
        found, template = match
        params = found.groupdict() if found else {}
        operation = self.document["paths"][template].get(method.lower())
        if operation is None:
            return template, params, None, [f"{method} is not an operation of {template}"]
        problems: list[str] = []
        declared = {(p["in"], p["name"]): p for p in operation.get("parameters", [])}
        for name, value in params.items():
            problems += self._schema_problems(declared[("path", name)]["schema"], value, f"path parameter {name}")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        for name, values in query.items():
            if ("query", name) not in declared:
                problems.append(f"query parameter {name!r} is not declared for {method} {template}")
            else:
                problems += self._schema_problems(declared[("query", name)]["schema"], values[-1], f"query parameter {name}")
        problems += [f"required query parameter {p['name']!r} is missing" for (where, name), p in declared.items()
                     if where == "query" and p.get("required") and name not in query]
        body = None
        request_body = operation.get("requestBody")
        if request_body is None:
            if raw:
                problems.append(f"{method} {template} takes no body")
            return template, params, body, problems
        content_type = headers.get("Content-Type", "").split(";")[0].strip().lower()
        media = request_body["content"].get(content_type)
        if media is None:
            return template, params, body, problems + [
                f"Content-Type {content_type or '(none)'} is not one of {', '.join(request_body['content'])}"]
        if not raw:
            if request_body.get("required"):
                problems.append(f"{method} {template} requires a body")
            return template, params, body, problems
        try:
            body = json.loads(raw)
        except ValueError as e:
            return template, params, body, problems + [f"the body is not JSON: {e}"]
        return template, params, body, problems + self._schema_problems(media["schema"], body, "body")

    def _schema_problems(self, schema: dict[str, Any], instance: Any, where: str) -> list[str]:
        validator = OAS30Validator({"components": self.components, **closed(schema)})
        return [f"{where} {'.'.join(map(str, e.absolute_path))}: {e.message}".replace(" :", ":")
                for e in validator.iter_errors(instance)]

    # -- the gateway and faas-netes ---------------------------------------------------------------------
    def behave(self, method: str, template: str, params: dict[str, str], body: Any) -> tuple[int, bytes]:
        """What the CE gateway and faas-netes answer to a well-formed request."""
        if template == "/system/functions" and method in ("POST", "PUT"):
            service = body["service"]
            if (body.get("namespace") or CE_DEFAULT_NAMESPACE) != CE_DEFAULT_NAMESPACE:
                return 400, f"namespace must be: {CE_DEFAULT_NAMESPACE}".encode()
            minimum = int((body.get("labels") or {}).get(function_labels.OPENFAAS_MIN_SCALE_LABEL, "0") or 0)
            if method == "PUT":
                if service not in self.functions:
                    return 404, f'unable update Deployment: {service}.{CE_DEFAULT_NAMESPACE}, error: deployments.apps "{service}" not found'.encode()
                self.functions[service] = body
                self.replicas[service] = minimum or self.replicas[service]
                return 202, b""
            if service in self.functions:
                return 500, f'unable create Deployment: deployments.apps "{service}" already exists'.encode()
            if len(self.functions) + 1 > CE_MAX_FUNCTIONS:
                return 400, f"unable to create function, maximum: {CE_MAX_FUNCTIONS}".encode()
            self.functions[service] = body
            self.replicas[service] = minimum or 1
            return 202, b""
        if template == "/system/scale-function/{functionName}":
            name = params["functionName"]
            if name not in self.functions:
                return 404, f"function {name} not found".encode()
            # the gateway's scaling handler clamps to CE's range before faas-netes sees it
            self.replicas[name] = min(max(body["replicas"], 1), function_labels.OPENFAAS_CE_MAX_REPLICAS)
            return 202, b""
        if template == "/system/function/{functionName}":
            name = params["functionName"]
            if name not in self.functions:
                return 404, b"Not Found"
            status = {"name": name, "image": self.functions[name]["image"], "replicas": self.replicas[name]}
            return 200, json.dumps(status).encode()
        return 501, b"the stand-in does not serve this operation"

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # the test's output stays quiet
                pass

            def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self) -> None:
                length = self.headers.get("Content-Length")
                if self.headers.get("Transfer-Encoding") or (length is not None and int(length) > MAX_REQUEST_BYTES):
                    standin.violations.append(f"{self.command} {self.path}: no bounded Content-Length")
                    self._answer(411, b"")
                    return
                raw = self.rfile.read(int(length or 0))
                headers = dict(self.headers.items())
                template, params, body, problems = standin.check(self.command, self.path, headers, raw)
                with standin._lock:
                    standin.requests.append(Recorded(self.command, urllib.parse.urlsplit(self.path).path,
                                                     urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query), headers, body))
                    if problems:
                        standin.violations += [f"{self.command} {self.path}: {p}" for p in problems]
                if problems:
                    self._answer(400, ("request does not match the API document: " + "; ".join(problems)).encode())
                    return
                if template.startswith("/system/") and headers.get("Authorization") != standin.credentials:
                    self._answer(401, b"invalid credentials", {"WWW-Authenticate": 'Basic realm="Restricted"'})
                    return
                fault = standin.faults.pop((self.command, urllib.parse.urlsplit(self.path).path), None)
                if fault is not None and fault.stall:
                    standin.release.wait(STALL_BOUND_S)
                    return
                if fault is not None and fault.trickle:
                    self.send_response(202)
                    self.send_header("Content-Length", str(1 << 20))
                    self.end_headers()
                    while not standin.release.wait(TRICKLE_S):
                        try:
                            self.wfile.write(b".")
                            self.wfile.flush()
                        except OSError:  # the client gave up
                            return
                    return
                if fault is not None:
                    self._answer(fault.status, fault.body)
                    return
                with standin._lock:
                    status, answer = standin.behave(self.command, template, params, body)
                self._answer(status, answer)

            def do_GET(self) -> None:
                self._serve()

            do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

        return Handler


@pytest.fixture
def gateway() -> Iterator[StandIn]:
    standin = StandIn(API_DOCUMENT, USER, PASSWORD)
    standin.start()
    yield standin
    standin.stop()
    assert standin.violations == [], "requests the API document does not describe"


def run_deploy(path: Path, url: str, *extra: str) -> int:
    """`lifl deploy` in this process (its exit status), with nothing taken from the environment."""
    args = build_parser().parse_args(["deploy", "-f", str(path), "--gateway", url, *extra])
    return openfaas.main(args)


@pytest.fixture(autouse=True)
def no_openfaas_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(openfaas.GATEWAY_ENV, raising=False)
    monkeypatch.delenv(openfaas.PASSWORD_ENV, raising=False)


def client(standin: StandIn, password: str | None = PASSWORD, **options: Any) -> openfaas.Gateway:
    return openfaas.Gateway(standin.url, USER, password, **options)


def stack_function(**changes: Any) -> openfaas.Function:
    (function,) = openfaas.read_stack(STACK).functions
    return openfaas.Function(**{**function.__dict__, **changes})


def test_the_stand_in_refuses_what_the_document_does_not_describe(gateway: StandIn) -> None:
    """The stand-in is strict: a wrong field, a missing one, another content type, an unknown path."""
    body = openfaas.function_deployment(stack_function())
    wrong = [("PUT", "/system/functions", {**body, "envvars": {}}, "application/json", "'envvars' was unexpected"),
             ("POST", "/system/functions", {k: v for k, v in body.items() if k != "image"}, "application/json",
              "'image' is a required property"),
             ("POST", "/system/scale-function/x", {"serviceName": "x", "replicas": 1}, "application/json",
              "'namespace' is a required property"),
             ("POST", "/system/scale-function/x", {"serviceName": "x", "namespace": "n", "replicas": -1}, "application/json",
              "-1 is less than the minimum of 0"),
             ("POST", "/system/functions", body, "text/plain", "Content-Type text/plain is not one of application/json"),
             ("PATCH", "/system/functions", body, "application/json", "PATCH is not an operation of /system/functions"),
             ("POST", "/system/deploy", body, "application/json", "/system/deploy: no such path")]
    for method, path, payload, content_type, problem in wrong:
        connection = http.client.HTTPConnection("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]), timeout=60)
        connection.request(method, path, json.dumps(payload), {"Content-Type": content_type, "Authorization": gateway.credentials})
        response = connection.getresponse()
        assert response.status == 400 and problem in response.read().decode(), (method, path, problem)
        connection.close()
        assert any(problem in v for v in gateway.violations)
    gateway.violations.clear()  # expected here


def test_first_deploy_creates_then_scales_to_the_minimum(gateway: StandIn, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert run_deploy(STACK, gateway.url, "--password-stdin") == 2  # stdin has no password: refused up front
    assert "standard input holds no password" in capsys.readouterr().err and gateway.requests == []
    monkeypatch.setenv(openfaas.PASSWORD_ENV, PASSWORD)
    assert run_deploy(STACK, gateway.url) == 0
    assert capsys.readouterr().out == f"{FUNCTION}: created at {gateway.url}, scaled to 1\n"
    assert gateway.paths() == [("PUT", "/system/functions"), ("POST", "/system/functions"),
                               ("POST", f"/system/scale-function/{FUNCTION}")]
    sent = gateway.requests[1].body
    assert sent == openfaas.function_deployment(openfaas.read_stack(STACK).functions[0])
    assert (sent["service"], sent["image"], sent["envProcess"], sent["readOnlyRootFilesystem"]) == \
        (FUNCTION, "dev.local/lifl/aggregator:0.1.0", "python3 index.py", True)
    assert gateway.requests[2].body == {"serviceName": FUNCTION, "namespace": "openfaas-fn", "replicas": 1}
    assert all(r.headers["Authorization"] == gateway.credentials for r in gateway.requests)
    assert gateway.replicas == {FUNCTION: 1}


def test_second_deploy_updates(gateway: StandIn, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(openfaas.PASSWORD_ENV, PASSWORD)
    assert run_deploy(STACK, gateway.url) == 0
    del gateway.requests[:]
    gateway.replicas[FUNCTION] = 4  # lifl's operator scaled it meanwhile
    assert run_deploy(STACK, gateway.url) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{FUNCTION}: updated at {gateway.url}, scaled to 1"
    assert gateway.paths() == [("PUT", "/system/functions"), ("POST", f"/system/scale-function/{FUNCTION}")]
    assert gateway.replicas[FUNCTION] == 1  # as faas-netes' own update does; the operator's next period scales it again


@pytest.mark.parametrize("status", [200, 202])  # the document says 200 for an update, faas-netes answers 202
def test_an_update_is_done_on_200_or_202(gateway: StandIn, status: int) -> None:
    function = stack_function()
    openfaas.deploy(client(gateway), function)
    gateway.fault("PUT", "/system/functions", Fault(status=status))
    assert openfaas.deploy(client(gateway), function) == "updated"


def test_scale_follows_the_stacks_minimum(gateway: StandIn, tmp_path: Path) -> None:
    path = tmp_path / "stack.yml"
    path.write_text(edit(set_in(*F, "labels", function_labels.OPENFAAS_MIN_SCALE_LABEL, "3")))
    (function,) = openfaas.read_stack(path).functions
    assert openfaas.deploy(client(gateway), function) == "created"
    assert gateway.requests[-1].body["replicas"] == 3 and gateway.replicas[FUNCTION] == 3


def test_the_password_comes_from_stdin(gateway: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(PASSWORD + "\n"))
    assert run_deploy(STACK, gateway.url, "--password-stdin") == 0
    assert gateway.requests[0].headers["Authorization"] == gateway.credentials


@pytest.mark.parametrize("password, given", [(None, "no password was given"), ("wrong", "the gateway refused user 'admin'")])
def test_an_auth_failure_is_reported_clearly(gateway: StandIn, password: str | None, given: str) -> None:
    with pytest.raises(openfaas.GatewayError) as refused:
        openfaas.deploy(client(gateway, password), stack_function())
    message = str(refused.value)
    assert message.startswith(f"PUT {gateway.url}/system/functions: HTTP 401 Unauthorized: invalid credentials")
    assert given in message and "--password-stdin or OPENFAAS_PASSWORD" in message
    assert gateway.paths() == [("PUT", "/system/functions")]  # nothing after a refusal


def test_a_gateway_refusal_names_status_and_body(gateway: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stack.yml"  # CE serves one namespace: faas-netes refuses another with a 400
    path.write_text(edit(set_in(*F, "namespace", "tenants")))
    monkeypatch.setenv(openfaas.PASSWORD_ENV, PASSWORD)
    assert run_deploy(path, gateway.url) == 1
    assert capsys.readouterr().err == (f"lifl deploy: {FUNCTION}: PUT {gateway.url}/system/functions: HTTP 400 Bad Request: "
                                       "namespace must be: openfaas-fn\n")


def test_a_server_error_is_reported_and_what_was_deployed_is_named(gateway: StandIn, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stack.yml"
    path.write_text(edit(many_functions(2)))
    gateway.fault("POST", "/system/scale-function/tenant1-aggregators", Fault(status=500, body=b"Unable to update\n\x1b[31mdeployment"))
    monkeypatch.setenv(openfaas.PASSWORD_ENV, PASSWORD)
    assert run_deploy(path, gateway.url) == 1
    captured = capsys.readouterr()
    assert captured.out == f"tenant0-aggregators: created at {gateway.url}, scaled to 1\n"
    assert captured.err == (f"lifl deploy: tenant1-aggregators: POST {gateway.url}/system/scale-function/tenant1-aggregators: "
                            "HTTP 500 Internal Server Error: Unable to update [31mdeployment "
                            "(deployed before it: tenant0-aggregators)\n")


def test_a_missing_function_on_scaling_is_reported(gateway: StandIn) -> None:
    gateway.fault("POST", f"/system/scale-function/{FUNCTION}", Fault(status=404, body=b"function not found"))
    with pytest.raises(openfaas.GatewayError, match=f"scale-function/{FUNCTION}: HTTP 404 Not Found: function not found"):
        openfaas.deploy(client(gateway), stack_function())


def test_long_error_bodies_are_cut(gateway: StandIn) -> None:
    body = b"x" * openfaas.MAX_RESPONSE_BYTES  # at the answer's limit: read, and shown cut
    gateway.fault("PUT", "/system/functions", Fault(status=500, body=body))
    with pytest.raises(openfaas.GatewayError) as refused:
        openfaas.deploy(client(gateway), stack_function())
    assert str(refused.value).endswith(": " + "x" * openfaas.MAX_ERROR_CHARS + f"... ({len(body)} bytes)")


def test_an_oversized_answer_is_refused(gateway: StandIn) -> None:
    gateway.fault("PUT", "/system/functions", Fault(status=500, body=b"x" * (openfaas.MAX_RESPONSE_BYTES + 1)))
    with pytest.raises(openfaas.GatewayError, match=f"PUT {gateway.url}/system/functions: the answer is larger than "
                                                    f"{openfaas.MAX_RESPONSE_BYTES} bytes"):
        openfaas.deploy(client(gateway), stack_function())


@pytest.mark.parametrize("fault", [Fault(stall=True), Fault(trickle=True)], ids=["no answer", "a trickle"])
def test_a_slow_gateway_is_cut_off(gateway: StandIn, fault: Fault) -> None:
    """A trickle keeps every read within the socket's timeout: only the whole-request deadline ends it."""
    gateway.fault("PUT", "/system/functions", fault)
    with pytest.raises(openfaas.GatewayError, match=f"PUT {gateway.url}/system/functions: no complete answer within 0.5 s"):
        openfaas.deploy(client(gateway, timeout_s=0.5), stack_function())
    gateway.release.set()


def test_no_gateway_is_reported() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(openfaas.GatewayError, match=f"PUT {url}/system/functions: .*refused"):
        openfaas.deploy(openfaas.Gateway(url, USER, PASSWORD), stack_function())


def test_lifl_deploy_runs_as_a_command(gateway: StandIn) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFAAS_")}
    r = subprocess.run([sys.executable, "-m", "lifl", "deploy", "-f", str(STACK), "--gateway", gateway.url, "--password-stdin"],
                       input=PASSWORD, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{FUNCTION}: created at {gateway.url}, scaled to 1\n", "")


@pytest.mark.parametrize("flag, stack_gateway, environment, url", [
    ("https://gw.example:8443/", "http://10.0.0.1:8080", {"OPENFAAS_URL": "http://env:8080"}, "https://gw.example:8443"),
    (None, "http://10.0.0.1:8080", {"OPENFAAS_URL": "http://env:8080"}, "http://10.0.0.1:8080"),
    (None, openfaas.DEFAULT_GATEWAY, {"OPENFAAS_URL": "http://env:8080"}, "http://env:8080"),  # faas-cli's exception
    (None, "", {}, openfaas.DEFAULT_GATEWAY),
    ("gateway.openfaas:8080", "", {}, "http://gateway.openfaas:8080"),
    (None, "https://example.org/openfaas", {}, "https://example.org/openfaas"),
])
def test_the_gateway_is_picked_as_faas_cli_picks_it(flag: str | None, stack_gateway: str, environment: dict[str, str],
                                                    url: str) -> None:
    assert openfaas.gateway_url(flag, stack_gateway, environment) == url


@pytest.mark.parametrize("flag, problem", [
    ("ftp://gw:21", "must be http:// or https:// and name a host"),
    ("http://admin:pw@gw:8080", "not in its URL"),
    ("http://gw:8080/?x=1", "must not have a query or fragment"),
    ("http://gw:port", "Port could not be cast"),
])
def test_bad_gateway_urls_are_refused(flag: str, problem: str) -> None:
    with pytest.raises(openfaas.SettingError, match=re.escape(problem)):
        openfaas.gateway_url(flag, "", {})


def test_a_gateway_with_a_path_prefix_gets_the_api_below_it(gateway: StandIn) -> None:
    with pytest.raises(openfaas.GatewayError, match="/prefix/system/functions: no such path"):
        openfaas.deploy(openfaas.Gateway(gateway.url + "/prefix", USER, PASSWORD), stack_function())
    gateway.violations.clear()  # the stand-in serves no prefix: the point is where the request went


def test_the_password_limits() -> None:
    at_limit = "p" * openfaas.MAX_PASSWORD_CHARS
    assert openfaas.read_password(True, io.StringIO(at_limit + "\n"), {}) == at_limit
    with pytest.raises(openfaas.SettingError, match=f"longer than {openfaas.MAX_PASSWORD_CHARS} characters"):
        openfaas.read_password(True, io.StringIO(at_limit + "pp"), {})
    with pytest.raises(openfaas.SettingError, match="give the password one way"):
        openfaas.read_password(True, io.StringIO("x"), {openfaas.PASSWORD_ENV: "y"})
    assert openfaas.read_password(False, io.StringIO(""), {}) is None


def test_a_password_over_plain_http_is_flagged() -> None:
    assert openfaas.Gateway("http://gw.example:8080", USER, PASSWORD).sends_password_in_clear
    assert not openfaas.Gateway("https://gw.example", USER, PASSWORD).sends_password_in_clear
    assert not openfaas.Gateway("http://127.0.0.1:8080", USER, PASSWORD).sends_password_in_clear
    assert not openfaas.Gateway("http://gw.example:8080", USER, None).sends_password_in_clear


@pytest.mark.parametrize("timeout, accepted", [("0", False), ("0.001", True), ("600", True), ("600.5", False), ("soon", False)])
def test_the_timeout_flag(timeout: str, accepted: bool, capsys: pytest.CaptureFixture[str]) -> None:
    if accepted:
        assert build_parser().parse_args(["deploy", "--timeout", timeout]).timeout == float(timeout)
    else:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["deploy", "--timeout", timeout])
        assert "--timeout" in capsys.readouterr().err


# -- the operator: faas-netes' Deployments of lifl functions --------------------------------------------


def faas_netes_deployment(name: str = FUNCTION, tenant: str | None = "acme", namespace: str = CE_DEFAULT_NAMESPACE,
                          extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A function's Deployment as faas-netes makes it (pkg/handlers/deploy.go, with SetNonRootUser and
    readOnlyRootFilesystem), as the API server returns it."""
    labels = {names.FAAS_FUNCTION_LABEL: name, function_labels.OPENFAAS_MIN_SCALE_LABEL: "1", function_labels.OPENFAAS_MAX_SCALE_LABEL: "5",
              **({function_labels.TENANT_LABEL: tenant} if tenant else {}), **(extra_labels or {})}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {names.FAAS_FUNCTION_LABEL: name},
                     "annotations": {"prometheus.io.scrape": "false"}},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {names.FAAS_FUNCTION_LABEL: name}},
            "template": {
                "metadata": {"name": name, "labels": labels, "annotations": {"prometheus.io.scrape": "false"}},
                "spec": {
                    "containers": [{
                        "name": name, "image": "dev.local/lifl/aggregator:0.1.0",
                        "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                        "env": [{"name": "LIFL_TENANT", "value": tenant or ""}, {"name": "fprocess", "value": "python3 index.py"}],
                        "securityContext": {"readOnlyRootFilesystem": True, "runAsUser": 12000},
                        "volumeMounts": [{"name": "temp", "mountPath": "/tmp"}],
                        "imagePullPolicy": "Always", "terminationMessagePath": "/dev/termination-log",
                    }],
                    "volumes": [{"name": "temp", "emptyDir": {}}],
                    "restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "securityContext": {},
                },
            },
        },
    }


@pytest.mark.parametrize("tenant, expected", [("acme", "acme"), (None, None)])
def test_the_tenant_of_a_function(tenant: str | None, expected: str | None) -> None:
    assert resources.openfaas_tenant(faas_netes_deployment(tenant=tenant)) == expected


def test_a_bad_tenant_label_is_named() -> None:
    with pytest.raises(resources.InvalidFunction, match="label lifl.dev/tenant must name a lifl tenant.*got 'Acme'"):
        resources.openfaas_tenant(faas_netes_deployment(tenant="Acme"))


@pytest.mark.parametrize("labels, bounds", [
    ({}, ScaleBounds(1, 5, 1)),  # CE's own defaults
    ({function_labels.OPENFAAS_MIN_SCALE_LABEL: "2", function_labels.OPENFAAS_MAX_SCALE_LABEL: "4"}, ScaleBounds(2, 4, 2)),
    ({function_labels.OPENFAAS_MIN_SCALE_LABEL: "5", function_labels.OPENFAAS_MAX_SCALE_LABEL: "5"}, ScaleBounds(5, 5, 5)),  # at CE's limit
])
def test_openfaas_scale_bounds(labels: dict[str, str], bounds: ScaleBounds) -> None:
    assert function_labels.openfaas_scale_bounds(labels) == bounds


@pytest.mark.parametrize("labels, problem", [
    ({function_labels.OPENFAAS_MAX_SCALE_LABEL: "6"}, "com.openfaas.scale.max must be between 1 and 5"),  # past CE's limit
    ({function_labels.OPENFAAS_MIN_SCALE_LABEL: "0"}, "com.openfaas.scale.min must be between 1 and 5"),
    ({function_labels.OPENFAAS_MIN_SCALE_LABEL: "a lot"}, "com.openfaas.scale.min must be a whole number of pods"),
    ({function_labels.OPENFAAS_MIN_SCALE_LABEL: "4", function_labels.OPENFAAS_MAX_SCALE_LABEL: "3"}, r"com.openfaas.scale.min \(4\) exceeds"),
])
def test_bad_openfaas_scale_labels_are_named(labels: dict[str, str], problem: str) -> None:
    with pytest.raises(function_labels.InvalidAnnotation, match=problem):
        function_labels.openfaas_scale_bounds(labels)


@pytest.mark.parametrize("demand, desired", [(0, 1), (1, 1), (3, 3), (5, 5), (6, 5), (40, 5)])
def test_function_replicas_follow_the_plan_within_ce(demand: int, desired: int) -> None:
    """CE has no scale to zero (an idle tenant keeps a warm pod) and no more than 5 replicas."""
    assert function_labels.openfaas_scale_bounds({}).clamp(demand) == desired


@pytest.mark.parametrize("deployment, ours", [
    (faas_netes_deployment(), True),
    (faas_netes_deployment(tenant=None), False),  # another OpenFaaS function
    (faas_netes_deployment(namespace="default"), False),  # not the functions namespace
    ({**faas_netes_deployment(), "metadata": {**faas_netes_deployment()["metadata"], "name": "impostor"}}, False),
])
def test_which_deployments_are_lifl_functions(deployment: dict[str, Any], ours: bool) -> None:
    assert handlers.is_lifl_function(deployment) is ours


def test_a_standing_problem_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lifl.autoscaler"):
        for _ in range(3):
            handlers._report("openfaas-fn/f", "the plan wants 7 aggregators")
        handlers._report("openfaas-fn/f", "the plan wants 9 aggregators")
        handlers._report("openfaas-fn/f", None)
        handlers._report("openfaas-fn/f", "the plan wants 9 aggregators")
    assert [r.getMessage() for r in caplog.records] == ["OpenFaaS function openfaas-fn/f: the plan wants 7 aggregators",
                                                        "OpenFaaS function openfaas-fn/f: the plan wants 9 aggregators",
                                                        "OpenFaaS function openfaas-fn/f: the plan wants 9 aggregators"]

