"""The operator's decisions, as tables: no Kubernetes, no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lifl import function_labels
from lifl.autoscaler import names, resources
from lifl.function_labels import ScaleBounds

NOW, LATER = "2026-11-24T00:00:00Z", "2026-11-24T00:01:00Z"


def pa(annotations: dict[str, str] | None = None, status: dict[str, Any] | None = None, reachability: str = "Reachable",
       labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling.internal.knative.dev/v1alpha1", "kind": "PodAutoscaler",
        "metadata": {"name": "acme-00001", "namespace": "default", "uid": "u-1", "generation": 3,
                     "annotations": {names.CLASS_ANNOTATION: names.CLASS, **(annotations or {})},
                     "labels": labels if labels is not None else {names.SERVICE_LABEL: "acme"}},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "acme-00001-deployment"},
                 "protocolType": "http1", "reachability": reachability},
        "status": status or {},
    }


INITIALIZED = {"conditions": [{"type": "ScaleTargetInitialized", "status": "True", "lastTransitionTime": NOW}]}


@pytest.mark.parametrize("annotations, bounds", [
    ({}, ScaleBounds(0, 0, 1)),
    ({names.MIN_SCALE_ANNOTATION: "2", names.MAX_SCALE_ANNOTATION: "9", names.INITIAL_SCALE_ANNOTATION: "3"}, ScaleBounds(2, 9, 3)),
    ({names.INITIAL_SCALE_ANNOTATION: " 0 "}, ScaleBounds(0, 0, 0)),
    ({names.MAX_SCALE_ANNOTATION: "10000"}, ScaleBounds(0, 10000, 1)),
])
def test_scale_bounds(annotations: dict[str, str], bounds: ScaleBounds) -> None:
    assert resources.scale_bounds(pa(annotations)) == bounds


@pytest.mark.parametrize("annotations, problem", [
    ({names.MIN_SCALE_ANNOTATION: "two"}, "min-scale must be a whole number of pods, got 'two'"),
    ({names.MAX_SCALE_ANNOTATION: "-1"}, "max-scale must be between 0 and 10000, got -1"),
    ({names.INITIAL_SCALE_ANNOTATION: "10001"}, "initial-scale must be between 0 and 10000, got 10001"),
    ({names.MIN_SCALE_ANNOTATION: "1.5"}, "min-scale must be a whole number"),
    ({names.MIN_SCALE_ANNOTATION: "5", names.MAX_SCALE_ANNOTATION: "4"}, "min-scale (5) exceeds autoscaling.knative.dev/max-scale (4)"),
])
def test_bad_scale_annotations_are_named(annotations: dict[str, str], problem: str) -> None:
    with pytest.raises(function_labels.InvalidAnnotation, match=problem.replace("(", r"\(").replace(")", r"\)")):
        resources.scale_bounds(pa(annotations))


@pytest.mark.parametrize("status, reachability, planned, bounds, desired", [
    ({}, "Reachable", 0, ScaleBounds(0, 0, 1), 1),  # not yet initialized: its initial scale
    ({}, "Reachable", 7, ScaleBounds(0, 0, 1), 1),
    ({}, "Reachable", 0, ScaleBounds(2, 0, 1), 2),  # ... or its minimum, if more
    ({}, "Reachable", 0, ScaleBounds(0, 0, 0), 0),
    (INITIALIZED, "Reachable", 0, ScaleBounds(0, 0, 1), 0),  # then the plan's demand: none is zero
    (INITIALIZED, "Reachable", 7, ScaleBounds(0, 0, 1), 7),
    (INITIALIZED, "Reachable", 7, ScaleBounds(0, 5, 1), 5),  # within max-scale
    (INITIALIZED, "Reachable", 1, ScaleBounds(3, 5, 1), 3),  # and min-scale
    (INITIALIZED, "Reachable", 50_000, ScaleBounds(0, 0, 1), function_labels.MAX_REPLICAS),
    (INITIALIZED, "Unreachable", 7, ScaleBounds(3, 5, 1), 0),  # an old revision: nothing
    ({}, "Unreachable", 7, ScaleBounds(3, 5, 1), 0),
])
def test_desired_scale(status: dict[str, Any], reachability: str, planned: int, bounds: ScaleBounds, desired: int) -> None:
    assert resources.desired_scale(pa(status=status, reachability=reachability), planned, bounds) == desired


@pytest.mark.parametrize("labels, tenant", [
    ({function_labels.TENANT_LABEL: "acme", names.SERVICE_LABEL: "aggregators"}, "acme"),
    ({names.SERVICE_LABEL: "globex"}, "globex"),
    ({}, "acme-00001"),
])
def test_tenant_of(labels: dict[str, str], tenant: str) -> None:
    assert resources.tenant_of(pa(labels=labels)) == tenant


def test_sks_is_owned_by_its_pa_and_serves_its_deployment() -> None:
    sks = resources.make_sks(pa())
    assert sks["metadata"]["name"] == "acme-00001" and sks["metadata"]["namespace"] == "default"
    assert sks["spec"] == {"mode": "Serve", "protocolType": "http1",
                           "objectRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "acme-00001-deployment"}}
    assert resources.owned_by(sks, pa())
    assert not resources.owned_by({"metadata": {"ownerReferences": [{"uid": "u-2", "controller": True}]}}, pa())
    assert not resources.spec_differs({"spec": {**sks["spec"], "numActivators": 0}}, sks)  # fields it does not set
    assert resources.spec_differs({"spec": {**sks["spec"], "mode": "Proxy"}}, sks)


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c.get("reason", "")) for c in status["conditions"]}


READY_SKS = {"status": {"serviceName": "acme-00001", "privateServiceName": "acme-00001-private",
                        "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.parametrize("status, sks, desired, actual, problem, expected", [
    ({}, None, 1, 0, "", {"SKSReady": ("Unknown", "NotReady"), "ScaleTargetInitialized": ("Unknown", "Queued"),
                          "Active": ("Unknown", "Activating"), "Ready": ("Unknown", "Activating")}),
    ({}, READY_SKS, 1, 0, "", {"SKSReady": ("True", ""), "ScaleTargetInitialized": ("Unknown", "Queued"),
                               "Active": ("Unknown", "Activating"), "Ready": ("Unknown", "Activating")}),
    ({}, READY_SKS, 1, 1, "", {"SKSReady": ("True", ""), "ScaleTargetInitialized": ("True", ""),
                               "Active": ("True", ""), "Ready": ("True", "")}),
    (INITIALIZED, READY_SKS, 0, 0, "", {"SKSReady": ("True", ""), "ScaleTargetInitialized": ("True", ""),
                                        "Active": ("False", "NoTraffic"), "Ready": ("False", "NoTraffic")}),
    (INITIALIZED, READY_SKS, 3, 3, "min-scale must be a whole number", {
        "SKSReady": ("True", ""), "ScaleTargetInitialized": ("True", ""), "Active": ("False", "InvalidScale"),
        "Ready": ("False", "InvalidScale")}),
])
def test_pa_status(status: dict[str, Any], sks: dict[str, Any] | None, desired: int, actual: int, problem: str,
                   expected: dict[str, tuple[str, str]]) -> None:
    out = resources.pa_status(pa(status=status), sks, desired, actual, LATER, problem)
    assert _conditions(out) == expected
    assert (out["desiredScale"], out["actualScale"], out["observedGeneration"]) == (desired, actual, 3)
    assert (out["serviceName"], out["metricsServiceName"]) == (("acme-00001", "acme-00001-private") if sks else ("", ""))


def test_status_is_written_only_when_it_changes() -> None:
    first = resources.pa_status(pa(), READY_SKS, 1, 1, NOW)
    again = resources.pa_status(pa(status=first), READY_SKS, 1, 1, LATER)
    assert again == first  # transition times kept: nothing to write
    assert resources.status_patch(pa(status=first), again) is None
    scaled = resources.pa_status(pa(status=first), READY_SKS, 2, 1, LATER)
    assert resources.status_patch(pa(status=first), scaled) == {"desiredScale": 2}


@pytest.mark.parametrize("desired, planned, labelled, chosen", [
    (0, {"n1": 3}, {"n1"}, set()),  # nothing asked for: no node carries the label
    (3, {"n1": 3}, set(), {"n1"}),  # BestFit packed them on one node
    (5, {"n1": 3, "n2": 2, "n3": 0}, {"n3"}, {"n1", "n2"}),  # the label moves off n3
    (2, {"elsewhere": 2}, {"n2"}, {"n2"}),  # plan for nodes Kubernetes does not have: keep what is labelled
    (1, {}, set(), {"n1"}),  # initial scale ahead of any plan: one node
])
def test_placement(desired: int, planned: dict[str, int], labelled: set[str], chosen: set[str]) -> None:
    assert resources.placement(desired, planned, ["n1", "n2", "n3"], labelled) == chosen


def test_label_patches_move_the_label() -> None:
    label = names.placement_label("acme")
    nodes = {"n1": {label: "true"}, "n2": {}, "n3": {label: "true", "other": "x"}}
    assert resources.label_patches(label, {"n1", "n2"}, nodes) == {"n2": {label: "true"}, "n3": {label: None}}
    assert resources.label_patches(label, {"n1", "n3"}, nodes) == {}


def test_deletion_costs_send_pods_off_dropped_nodes_first() -> None:
    pods = [("a", "n1", None), ("b", "n2", resources.KEEP_COST), ("c", "n3", resources.DROP_COST), ("d", "", None)]
    assert resources.deletion_costs(pods, {"n1", "n3"}) == {
        "a": resources.KEEP_COST, "b": resources.DROP_COST, "c": resources.KEEP_COST, "d": resources.DROP_COST}


def test_an_fljob_is_a_lifl_job() -> None:
    from lifl.jobs import JobSpec

    spec = JobSpec.from_request(resources.job_request("mnist", {"tenant": "acme", "goal": 20, "leafFanIn": 4,
                                                                "roundDeadlineSeconds": 120.0, "leaseTTLSeconds": 60,
                                                                "strategy": {"name": "fedadam", "eta": 0.01},
                                                                "fixedPoint": {"frac_bits": 20}}))
    assert (spec.job, spec.tenant, spec.goal, spec.leaf_fan_in, spec.round_deadline_s, spec.lease_ttl_s) == \
        ("mnist", "acme", 20, 4, 120.0, 60)
    assert (spec.strategy_spec.name, spec.strategy_spec.param("eta")) == ("fedadam", 0.01)
    assert spec.fixed_point_spec is not None and spec.fixed_point_spec.frac_bits == 20


@pytest.mark.parametrize("spec, problem", [
    ({"goal": 0}, "goal"),
    ({"goal": 5, "tenant": "Acme"}, "tenant must be"),
    ({"goal": 5, "colour": "red"}, "unknown job field"),
    ({"tenant": "acme"}, "'goal' is required"),
])
def test_a_bad_fljob_is_refused_with_its_reason(spec: dict[str, Any], problem: str) -> None:
    import kopf

    from lifl.autoscaler.handlers import job_spec

    with pytest.raises(kopf.PermanentError, match=problem):
        job_spec("mnist", spec)


# -- lifl bench knative's pure parts: Knative's stat.proto encoding, and the traces ------------------------
def _stat_classes() -> tuple[Any, Any]:
    """Knative's metrics.Stat and WireStatMessages, built from stat.proto's definition."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="knative_stat_test.proto", package="metrics", syntax="proto3")
    stat = f.message_type.add(name="Stat")
    t = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind) in enumerate([("pod_name", t.TYPE_STRING), ("average_concurrent_requests", t.TYPE_DOUBLE),
                                           ("average_proxied_concurrent_requests", t.TYPE_DOUBLE), ("request_count", t.TYPE_DOUBLE),
                                           ("proxied_request_count", t.TYPE_DOUBLE), ("process_uptime", t.TYPE_DOUBLE),
                                           ("timestamp", t.TYPE_INT64)], start=1):
        stat.field.add(name=name, number=number, type=kind, label=t.LABEL_OPTIONAL)
    wire = f.message_type.add(name="WireStatMessage")
    wire.field.add(name="namespace", number=1, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    wire.field.add(name="name", number=2, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    wire.field.add(name="stat", number=3, type=t.TYPE_MESSAGE, type_name=".metrics.Stat", label=t.LABEL_OPTIONAL)
    wires = f.message_type.add(name="WireStatMessages")
    wires.field.add(name="messages", number=1, type=t.TYPE_MESSAGE, type_name=".metrics.WireStatMessage", label=t.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("metrics.Stat")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("metrics.WireStatMessages")))


def test_stats_are_encoded_as_knatives_stat_proto() -> None:
    from lifl.bench.knative import encode_stat, encode_wire

    stat_class, wire_class = _stat_classes()
    stat = stat_class.FromString(encode_stat("pod-1", 3.5, 7.0, 12.25, 1_790_000_000))
    assert (stat.pod_name, stat.average_concurrent_requests, stat.request_count, stat.process_uptime, stat.timestamp) == \
        ("pod-1", 3.5, 7.0, 12.25, 1_790_000_000)
    wire = wire_class.FromString(encode_wire("default", "kpa-00001", encode_stat("activator", 40.0, 40.0, 0.0, 1)))
    assert [(m.namespace, m.name, m.stat.pod_name, m.stat.average_concurrent_requests) for m in wire.messages] == \
        [("default", "kpa-00001", "activator", 40.0)]


def test_the_traces() -> None:
    from lifl.bench import knative

    bursty = knative.bursty(bursts=2, size=4, spread_s=2.0, gap_s=10.0)
    assert bursty.arrivals == [8.0, 8.5, 9.0, 9.5, 18.0, 18.5, 19.0, 19.5] and bursty.goal == 4
    assert bursty.first_burst_s == 18.0
    demo = knative.demo()
    recorded = json.loads(knative.DEMO_TRACE.read_text())
    assert len(demo.arrivals) == recorded["arrivals"][-1] and demo.arrivals == sorted(demo.arrivals)
    assert demo.goal == recorded["goal"] and min(demo.arrivals) >= knative.TRAINING_S


def test_a_kpa_pod_takes_at_most_its_container_concurrency_and_the_rest_wait_at_the_activator() -> None:
    import urllib.request

    from lifl.bench.knative import SERVICE_S, KpaLoad

    stat_class, wire_class = _stat_classes()
    now = [0.0]
    load = KpaLoad("kpa-00001", concurrency=2, port=0, clock=lambda: now[0])
    for _ in range(5):
        load.arrive(0.0)
    # no pod yet: the activator holds all five and says so
    assert wire_class.FromString(load.activator_stat()).messages[0].stat.average_concurrent_requests == 5.0
    pods = {"p1": "127.0.0.1", "p2": "127.0.0.1"}
    load.set_pods(pods, 0.0)
    try:
        assert sorted(len(ends) for ends in load.busy.values()) == [2, 2] and len(load.held) == 1
        scraped = {}
        for pod in pods:  # each pod's metrics, as Knative's autoscaler scrapes them
            port = load.servers[pod].server_address[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                assert r.headers["Content-Type"] == "application/protobuf"
                stat = stat_class.FromString(r.read())
            scraped[stat.pod_name] = (stat.average_concurrent_requests, stat.request_count)
        assert scraped == {"p1": (2.0, 2.0), "p2": (2.0, 2.0)}
        # the first requests end SERVICE_S after they started: the waiting one takes a freed slot
        now[0] = SERVICE_S + 0.01
        load.set_pods(pods, now[0])
        assert sorted(len(ends) for ends in load.busy.values()) == [0, 1] and not load.held
    finally:
        load.close()
    assert not load.servers


@pytest.mark.parametrize("samples, first, burst_end, expected", [
    ([], 5.0, 9.0, {"pod_seconds": 0.0, "scale_up_s": None, "zero_s": 0.0}),
    # from the first update (0.5 s) to the first burst's most pods (3, at 1.5 s); a later peak is another burst's
    ([(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 3), (2.5, 5)], 0.5, 2.5,
     {"pod_seconds": 7.0, "scale_up_s": 1.0, "zero_s": 0.5}),
    ([(0.0, 4), (0.5, 4), (1.0, 2)], 0.5, 9.0, {"pod_seconds": 5.0, "scale_up_s": 0.0, "zero_s": 0.0}),  # ready ahead
])
def test_timeline_figures(samples: list[tuple[float, int]], first: float, burst_end: float, expected: dict[str, Any]) -> None:
    from lifl.bench.knative import Timeline

    figures = Timeline(samples, {"a", "b"}).figures(first, burst_end)
    assert {k: figures[k] for k in expected} == expected and figures["cold_starts"] == 2


@pytest.mark.parametrize("traces", ["nope", "demo,nope", ","])
def test_bench_knative_refuses_unknown_traces_before_starting_anything(traces: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lifl", "bench", "knative", "--traces", traces],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown trace" in r.stderr and "choose from demo, bursty" in r.stderr
