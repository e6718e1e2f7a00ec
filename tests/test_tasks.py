"""The node's task board (``lifl.node.tasks.Board``) as a pure state machine: events in, effects out.

Each table row is a scene on one node: a board, the small tree view it reads (``TASKS``: round 0
of job j, whose leaves 1 and 2 feed middle 3, which feeds top 4; a leaf of job m, of the same
tenant; a leaf of job k, of another tenant), a clock that ticks once an event, and the effects
each event must return, spelled compactly (``spell``). The events are the board's calls as the
agent makes them (an input is delivered and the board dispatches; a task or a query is over, an
instance attaches, and the board dispatches). Covered: cold starts within ``max_instances``,
reuse of the tenant's most recently used idle instance, producers first, a task waiting for its
producer's instance, what an invocation carries, reruns up to ``MAX_TASK_ATTEMPTS`` then
``Abandon``, folds, resizes, cancellation, instances gone, queries (inference ones on instances
that preloaded torch), scale to zero, prewarming, and counts.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count
from typing import Any

import pytest

from lifl.keys.record import KIND_CLOSE, KeyMessage
from lifl.node.tasks import (
    MAX_TASK_ATTEMPTS, Abandon, Board, CancelRun, Effect, Invoke, InvokeQuery, QueryFailed, ReleaseObjects,
    ReleaseScratch, Rerun, SendKeys, Spawn, Stop,
)
from lifl.node.tree import OPEN, Task
from lifl.protocol import LEAF, MIDDLE, TOP

TENANTS = {"j": "a", "m": "a", "k": "b"}  # job -> tenant
TASKS = {  # id: (job, role, fan-in)
    1: ("j", LEAF, 2), 2: ("j", LEAF, 2), 3: ("j", MIDDLE, OPEN), 4: ("j", TOP, OPEN),
    5: ("k", LEAF, 2),
    6: ("m", LEAF, 2),
}
FEEDS = {3: [1, 2], 4: [3]}  # task -> the tasks whose results are its inputs

Event = tuple[Any, ...]
Step = tuple[Event, list[str]]


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def number(k: bytes) -> int:
    return int.from_bytes(k, "little")


SPELLINGS: dict[type, Callable[[Any], str]] = {  # each effect, compactly
    Invoke: lambda e: f"I:{e.task.id}@{e.instance}",
    InvokeQuery: lambda e: f"Q:{e.query}@{e.instance}",
    SendKeys: lambda e: f"K@{e.instance}:" + ",".join(
        f"close={m.count}" if m.kind == KIND_CLOSE else str(number(m.key)) for m in e.messages),
    Spawn: lambda e: f"Sp:{e.instance}:{e.tenant}:{e.reason}" + ("+torch" if e.preload else ""),
    Stop: lambda e: f"St:{e.instance}",
    CancelRun: lambda e: f"Cx:{e.task}@{e.instance}",
    ReleaseObjects: lambda e: f"Rel:{e.task}",
    ReleaseScratch: lambda e: f"Scr:{e.task}",
    Rerun: lambda e: f"Re:{e.task.id}:{e.folded}+{e.unfolded}",
    Abandon: lambda e: f"Ab:{e.task.id}",
    QueryFailed: lambda e: f"QF:{e.query}",
}


def spell(effects: list[Effect]) -> list[str]:
    """I:task@instance, Q:query@instance, K@instance:keys (close=n: a new fan-in), Sp:instance:tenant:reason
    (+torch: preloaded), St:instance, Cx:task@instance, Rel:task, Scr:task, Re:task:folded+unfolded,
    Ab:task, QF:query; an effect these tests do not know fails them (KeyError)."""
    return [SPELLINGS[type(e)](e) for e in effects]


class Scene:
    """A board, the tree view it reads (plain data: the tree's tasks, who feeds whom, each job's
    tenant) and a clock that ticks one second an event. Inputs get keys 1, 2, 3... in order."""

    def __init__(self, max_instances: int = 2, *, reuse: bool = True, pods: bool = False) -> None:
        self.board = Board(max_instances, reuse=reuse, starts_instances=not pods)
        self.tasks = {i: Task(i, job, 0, 0, role, fan_in) for i, (job, role, fan_in) in TASKS.items()}
        self.now = 1000.0
        self.keys = count(1)
        self.effects: list[Effect] = []  # the last event's

    def producers(self, task: int) -> list[int]:
        return [p for p in FEEDS.get(task, []) if p in self.tasks]

    def tenant_of(self, job: str) -> str:
        return TENANTS[job]

    def context(self) -> tuple[dict[int, Task], Callable[[int], list[int]], Callable[[str], str], float]:
        return self.tasks, self.producers, self.tenant_of, self.now

    def run(self, event: Event) -> list[str]:
        """Apply ``event``; its effects, spelled (``T:task``: the board said the task is over)."""
        self.now += 1.0
        b, over = self.board, list[str]()
        match event:
            case ("give", task):
                n = next(self.keys)
                message = KeyMessage(dest=0, task=task, key=key(n), samples=n, count=1)
                self.effects = b.deliver(self.tasks[task], message) + b.dispatch(*self.context())
            case ("done", instance, task):
                finished = b.through(instance, task, self.now)
                if finished is not None:
                    over = [f"T:{finished.id}"]
                    self.tasks.pop(finished.id, None)  # the tree lets go of a finished task (if it had not)
                self.effects = b.dispatch(*self.context())
            case ("fail", instance, task):
                self.effects = b.failed(instance, task, "boom", *self.context())
            case ("gone", instance):
                self.effects = b.gone(instance, "killed", *self.context())
            case ("fold", task, keys, state):
                b.folded(task, [key(k) for k in keys], key(state), 0)
                self.effects = []
            case ("handed_off", task):
                b.result_exists(task)
                self.effects = []
            case ("resize", task, fan_in):
                self.tasks[task].fan_in = fan_in  # as the tree resizes its task
                self.effects = b.resize(task, fan_in)
            case ("cancel", task):
                self.tasks.pop(task)  # the tree lets go of the tasks it calls off
                self.effects = b.cancel(task, "round over")
            case ("query", query, tenant, inference):
                self.effects = b.query(query, tenant, inference, *self.context())
            case ("query_over", instance, query):
                b.query_over(instance, query, self.now)
                self.effects = b.dispatch(*self.context())
            case ("drop_query", query):
                self.effects = b.drop_query(query)
            case ("attach", tenant):
                b.attached(b.new_instance_id(), tenant, self.now)
                self.effects = b.dispatch(*self.context())
            case ("expire", keep_warm, keep):
                self.effects = b.expire(self.now, keep_warm, keep)
            case ("warm", wanted):
                self.effects = b.warm(wanted, *self.context())
            case ("wait", seconds):
                self.now += seconds - 1.0
                self.effects = []
            case _:
                raise AssertionError(f"unknown event {event!r}")
        return over + spell(self.effects)

    def play(self, steps: list[Step]) -> None:
        assert [self.run(event) for event, _ in steps] == [expected for _, expected in steps]

    def invoke(self) -> Invoke:
        """The last event's invocation."""
        invokes = [e for e in self.effects if isinstance(e, Invoke)]
        assert len(invokes) == 1, self.effects
        return invokes[0]


# -- placement -------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,steps", [
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 1), ["K@1:2"]),  # an input of a running task goes to its instance
        (("done", 1, 1), ["T:1"]),
        (("give", 6), ["I:6@1"]),  # the idle instance of the tenant: no cold start
    ], id="cold-start-then-the-warm-instance-is-reused"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 5), ["Sp:2:b:cold_start", "I:5@2"]),
        (("give", 6), []),  # max_instances reached: it waits
        (("give", 2), []),
        (("warm", {"a": 3}), []),  # no prewarming past the limit either
        (("done", 1, 1), ["T:1", "I:6@1"]),  # the first to wait goes first
        (("done", 1, 6), ["T:6", "I:2@1"]),
    ], id="cold-starts-up-to-max-instances-then-tasks-wait"),
    pytest.param({"max_instances": 1}, [
        (("give", 5), ["Sp:1:b:cold_start", "I:5@1"]),
        (("done", 1, 5), ["T:5"]),
        (("give", 1), []),  # the idle instance is tenant b's: never borrowed; the node is full
        (("expire", 0.0, {}), ["St:1"]),
        (("gone", 1), ["Sp:2:a:cold_start", "I:1@2"]),  # its end makes room
    ], id="another-tenants-idle-instance-is-never-borrowed"),
    pytest.param({"max_instances": 1}, [
        (("give", 5), ["Sp:1:b:cold_start", "I:5@1"]),
        (("done", 1, 5), ["T:5"]),
        (("give", 1), []),
        (("gone", 1), ["Sp:2:a:cold_start", "I:1@2"]),
    ], id="an-idle-instance-gone-makes-room"),
    pytest.param({"max_instances": 1}, [
        (("give", 6), ["Sp:1:a:cold_start", "I:6@1"]),
        (("give", 4), []),
        (("give", 3), []),
        (("give", 2), []),
        (("done", 1, 6), ["T:6", "I:2@1"]),  # the leaf, which came last
        (("done", 1, 2), ["T:2", "I:3@1"]),  # then the middle
        (("done", 1, 3), ["T:3", "I:4@1"]),  # then the top
    ], id="producers-first-on-a-full-node"),
    pytest.param({"max_instances": 3}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 3), []),  # room for a cold start, but its producer's instance comes free for it
        (("done", 1, 1), ["T:1", "I:3@1"]),
        (("give", 4), []),  # likewise the top, whose middle runs
        (("done", 1, 3), ["T:3", "I:4@1"]),
    ], id="a-task-waits-for-the-instance-of-its-running-producer"),
    pytest.param({"max_instances": 3}, [
        (("give", 6), ["Sp:1:a:cold_start", "I:6@1"]),
        (("give", 3), ["Sp:2:a:cold_start", "I:3@2"]),  # task 6 does not feed it
        (("give", 4), []),  # but the top waits for its middle's
    ], id="a-busy-instance-that-runs-no-producer-is-not-waited-for"),
    pytest.param({"max_instances": 3, "reuse": False}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 3), ["Sp:2:a:cold_start", "I:3@2"]),  # no waiting for the producer's instance
        (("done", 1, 1), ["T:1"]),
        (("give", 6), ["Sp:3:a:cold_start", "I:6@3"]),  # nor reuse of an idle one
        (("give", 2), []),  # max_instances (the agent stops instances when they are through)
    ], id="without-reuse-every-task-cold-starts"),
    pytest.param({"max_instances": 2, "pods": True}, [
        (("give", 1), []),  # pods attach: the board starts none
        (("attach", "a"), ["I:1@1"]),
        (("give", 6), []),
        (("warm", {"a": 2}), []),
        (("expire", 0.0, {}), []),  # pods are the cluster's to scale down
        (("done", 1, 1), ["T:1", "I:6@1"]),
    ], id="pods-attach-instead-of-cold-starts"),
])
def test_placement(options: dict[str, Any], steps: list[Step]) -> None:
    Scene(**options).play(steps)


@pytest.mark.parametrize("first,last", [pytest.param((1, 1), (2, 6), id="2"), pytest.param((2, 6), (1, 1), id="1")])
def test_the_most_recently_used_idle_instance_is_reused(first: tuple[int, int], last: tuple[int, int]) -> None:
    Scene(3).play([
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 6), ["Sp:2:a:cold_start", "I:6@2"]),
        (("done", *first), [f"T:{first[1]}"]),
        (("done", *last), [f"T:{last[1]}"]),
        (("give", 2), [f"I:2@{last[0]}"]),  # the instance freed last
    ])


@pytest.mark.parametrize("events,fan_in,inputs,first_for_job,parent", [
    pytest.param([("give", 1)], 2, [1], True, (0, 0), id="the-first-task-of-a-job-on-an-instance-brings-its-model-spec"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 2)], 2, [2], False, (0, 0), id="an-instance-that-knows-the-job"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 6)], 2, [2], True, (0, 0), id="an-instance-new-to-the-job"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 3), ("give", 2)], 2, [3], True, (1, 3),
                 id="a-leaf-learns-its-running-middle"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 3), ("give", 6)], 2, [3], True, (0, 0),
                 id="another-jobs-middle-is-no-parent"),
    pytest.param([("give", 6), ("give", 5), ("give", 2), ("give", 2), ("done", 1, 6)], 2, [3, 4], True, (0, 0),
                 id="inputs-given-while-waiting-come-with-the-invocation"),
    pytest.param([("give", 6), ("give", 5), ("give", 3), ("resize", 3, 4), ("done", 1, 6)], 4, [3], True, (0, 0),
                 id="a-task-resized-before-it-starts-starts-with-its-fan-in"),
    pytest.param([("give", 3)], OPEN, [1], True, (0, 0), id="a-middle-starts-with-its-fan-in-open"),
])
def test_what_an_invocation_carries(events: list[Event], fan_in: int, inputs: list[int], first_for_job: bool,
                                    parent: tuple[int, int]) -> None:
    scene = Scene(2)
    for event in events:
        scene.run(event)
    invoke = scene.invoke()
    assert (invoke.fan_in, [number(m.key) for m in invoke.inputs], invoke.first_for_job, invoke.parent) \
        == (fan_in, inputs, first_for_job, parent)


# -- runs that end without a result ------------------------------------------------------------------
@pytest.mark.parametrize("options,steps", [
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:1@1"]),  # the instance is free: it runs the task again
    ], id="a-failed-run-runs-again"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Rel:1", "Ab:1"]),  # MAX_TASK_ATTEMPTS runs: the round is abandoned
        (("fail", 1, 1), []),  # it runs no more
        (("give", 6), ["I:6@1"]),  # its instance is free
    ], id="max-attempts-then-abandon"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 6), []),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:6@1"]),  # it waits its turn again
        (("done", 1, 6), ["T:6", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Rel:1", "Ab:1"]),
    ], id="a-rerun-waits-behind-tasks-that-waited-before"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 6), ["Sp:2:a:cold_start", "I:6@2"]),
        (("gone", 1), ["Scr:1", "Re:1:0+1", "Sp:3:a:cold_start", "I:1@3"]),
        (("gone", 3), ["Scr:1", "Re:1:0+1", "Sp:4:a:cold_start", "I:1@4"]),
        (("gone", 4), ["Scr:1", "Rel:1", "Ab:1"]),
    ], id="an-instance-gone-mid-run-counts-as-a-run"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("handed_off", 1), []),
        (("gone", 1), ["Scr:1", "Rel:1"]),  # its result is the round's already
    ], id="a-task-whose-result-exists-is-not-run-again"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("fail", 2, 1), []),  # instance 2 does not run it
        (("done", 2, 1), []),
        (("gone", 2), []),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:1@1"]),
    ], id="reports-about-a-task-from-another-instance-are-ignored"),
])
def test_reruns(options: dict[str, Any], steps: list[Step]) -> None:
    assert MAX_TASK_ATTEMPTS == 3  # the tables spell out three runs
    Scene(**options).play(steps)


@pytest.mark.parametrize("folds,rerun,inputs,fan_in", [
    pytest.param([], "Re:1:0+2", [1, 2], 2, id="nothing-folded-runs-from-its-inputs"),
    pytest.param([([1], 10)], "Re:1:1+1", [10, 2], 2, id="from-its-accumulator-and-the-input-not-folded"),
    pytest.param([([2], 10)], "Re:1:1+1", [10, 1], 2, id="folded-out-of-order"),
    pytest.param([([1, 2], 10)], "Re:1:2+0", [10], 1, id="from-its-accumulator-alone-one-input"),
    pytest.param([([1], 10), ([10, 2], 11)], "Re:1:2+0", [11], 1, id="from-its-latest-accumulator"),
])
def test_a_rerun_starts_from_the_latest_accumulator(folds: list[tuple[list[int], int]], rerun: str, inputs: list[int],
                                                    fan_in: int) -> None:
    scene = Scene(2)
    scene.play([(("give", 1), ["Sp:1:a:cold_start", "I:1@1"]), (("give", 1), ["K@1:2"])])
    for keys, state in folds:
        scene.run(("fold", 1, keys, state))
    assert scene.run(("fail", 1, 1)) == ["Scr:1", rerun, "I:1@1"]
    invoke = scene.invoke()
    assert ([number(m.key) for m in invoke.inputs], invoke.fan_in) == (inputs, fan_in)


@pytest.mark.parametrize("folds,released,previous,state,unfolded", [
    pytest.param([([1], 10)], [[1]], [None], (10, 1, 1), [2, 3], id="an-input-folded"),
    pytest.param([([3, 1], 10)], [[3, 1]], [None], (10, 4, 2), [2], id="two-inputs-in-any-order"),
    pytest.param([([1, 2], 10), ([10, 3], 11)], [[1, 2], [3]], [None, 10], (11, 6, 3), [],
                 id="the-previous-accumulator-folded-in-is-given-back"),
])
def test_folds(folds: list[tuple[list[int], int]], released: list[list[int]], previous: list[int | None],
               state: tuple[int, int, int], unfolded: list[int]) -> None:
    """Inputs 1, 2, 3 (samples 1, 2, 3: one client update each); ``state``: the accumulator's
    (key, samples, updates)."""
    scene = Scene(2)
    for _ in range(3):
        scene.run(("give", 3))
    board = scene.board
    got = [board.folded(3, [key(k) for k in keys], key(s), 0) for keys, s in folds]
    assert [[number(m.key) for m in inputs] for inputs, _ in got] == released
    assert [number(p.key) if p is not None else None for _, p in got] == previous
    progress = board.progress[3]
    assert progress.state is not None
    assert (number(progress.state.key), progress.state.samples, progress.state.count) == state
    assert [number(m.key) for m in progress.unfolded] == unfolded
    assert progress.known() == {key(k) for k in (state[0], *unfolded)}


@pytest.mark.parametrize("events,closes", [
    pytest.param([("give", 3)], ["K@1:close=3"], id="a-running-task-learns-its-fan-in"),
    pytest.param([("give", 5), ("give", 6), ("give", 3)], [], id="a-task-not-started-is-invoked-with-it"),
    pytest.param([("give", 3), ("give", 3), ("give", 3), ("fold", 3, [1, 2], 10), ("fail", 1, 3)], ["K@1:close=2"],
                 id="a-rerun-counts-its-accumulator-as-one-input"),
])
def test_resize(events: list[Event], closes: list[str]) -> None:
    scene = Scene(2)
    for event in events:
        scene.run(event)
    assert scene.run(("resize", 3, 3)) == closes


# -- cancellation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,steps", [
    pytest.param({"max_instances": 1}, [
        (("give", 6), ["Sp:1:a:cold_start", "I:6@1"]),
        (("give", 1), []),
        (("cancel", 1), ["Rel:1"]),  # it waited: its objects go at once
        (("done", 1, 6), ["T:6"]),  # and it never runs
    ], id="a-waiting-task-lets-its-objects-go-at-once"),
    pytest.param({"max_instances": 1}, [
        (("cancel", 4), ["Rel:4"]),
    ], id="a-task-never-given-an-input"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 6), []),
        (("cancel", 1), ["Cx:1@1"]),  # it keeps its objects: its instance may still write into them
        (("done", 1, 1), ["T:1", "I:6@1"]),  # acknowledged: the instance is free
    ], id="a-running-task-is-told-to-stop"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 6), []),
        (("fail", 1, 1), ["Scr:1", "Re:1:0+1", "I:6@1"]),
        (("cancel", 1), ["Rel:1"]),
        (("done", 1, 6), ["T:6"]),
    ], id="a-rerun-waiting-for-an-instance"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("cancel", 1), ["Cx:1@1"]),
        (("gone", 1), ["Scr:1", "Rel:1"]),  # called off: it does not run again, and nothing acknowledges
    ], id="a-called-off-task-whose-instance-dies-is-over"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("cancel", 1), ["Cx:1@1"]),
        (("fail", 1, 1), ["Scr:1", "Rel:1"]),
    ], id="a-called-off-task-that-fails-is-over"),
])
def test_cancel(options: dict[str, Any], steps: list[Step]) -> None:
    scene = Scene(**options)
    scene.play(steps)
    board = scene.board
    for task in (event[1] for event, _ in steps if event[0] == "cancel"):  # no trace of it is left
        assert [task in held for held in (board.waiting, board.pending, board.progress, board.placed)] == [False] * 4


# -- queries -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,steps", [
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("done", 1, 1), ["T:1"]),
        (("query", 7, "a", False), ["Q:7@1"]),
    ], id="a-query-runs-on-an-idle-instance-of-its-tenant"),
    pytest.param({"max_instances": 2}, [
        (("query", 7, "a", False), ["Sp:1:a:query", "Q:7@1"]),
        (("query", 8, "a", False), ["Sp:2:a:query", "Q:8@2"]),
        (("query", 9, "a", False), []),  # max_instances
        (("query_over", 2, 8), ["Q:9@2"]),
        (("query_over", 1, 7), []),
        (("give", 1), ["I:1@1"]),  # the free instance (2 runs query 9)
    ], id="queries-scale-out-up-to-max-instances"),
    pytest.param({"max_instances": 1}, [
        (("give", 6), ["Sp:1:a:cold_start", "I:6@1"]),
        (("query", 7, "a", False), []),
        (("give", 1), []),
        (("done", 1, 6), ["T:6", "I:1@1"]),  # the task goes first, though the query waited longer
        (("done", 1, 1), ["T:1", "Q:7@1"]),
    ], id="tasks-go-before-queries"),
    pytest.param({"max_instances": 2}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("done", 1, 1), ["T:1"]),
        (("query", 7, "a", True), ["Sp:2:a:query+torch", "Q:7@2"]),  # room: the idle instance stays
        (("query_over", 2, 7), []),
        (("query", 8, "a", True), ["Q:8@2"]),  # the instance with torch is reused
        (("query_over", 2, 8), []),
        (("give", 2), ["I:2@2"]),  # and it runs tasks too
    ], id="an-inference-query-needs-an-instance-with-torch"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("done", 1, 1), ["T:1"]),
        (("query", 7, "a", True), ["St:1", "Sp:2:a:query+torch", "Q:7@2"]),
    ], id="on-a-full-node-an-inference-query-replaces-an-idle-instance"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("query", 7, "a", True), []),  # nothing idle to replace
        (("done", 1, 1), ["T:1", "St:1", "Sp:2:a:query+torch", "Q:7@2"]),
    ], id="on-a-full-busy-node-an-inference-query-waits"),
    pytest.param({"max_instances": 1, "pods": True}, [
        (("attach", "a"), []),
        (("query", 7, "a", True), []),  # pods are not stopped to make room
        (("query", 8, "a", False), ["Q:8@1"]),
    ], id="pods-are-not-replaced"),
    pytest.param({"max_instances": 1}, [
        (("query", 7, "a", False), ["Sp:1:a:query", "Q:7@1"]),
        (("give", 1), []),
        (("gone", 1), ["QF:7", "Sp:2:a:cold_start", "I:1@2"]),
        (("gone", 2), ["Scr:1", "Re:1:0+1", "Sp:3:a:cold_start", "I:1@3"]),
    ], id="a-query-whose-instance-dies-fails"),
    pytest.param({"max_instances": 1}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("query", 7, "a", False), []),
        (("drop_query", 7), []),  # it waited: forgotten
        (("done", 1, 1), ["T:1"]),
        (("drop_query", 7), []),
    ], id="a-waiting-query-timed-out-is-forgotten"),
    pytest.param({"max_instances": 1}, [
        (("query", 7, "a", False), ["Sp:1:a:query", "Q:7@1"]),
        (("give", 1), []),
        (("drop_query", 7), ["St:1"]),  # it ran for nobody: its instance goes
        (("gone", 1), ["Sp:2:a:cold_start", "I:1@2"]),  # no QueryFailed: it is over already
    ], id="a-running-query-timed-out-stops-its-instance"),
])
def test_queries(options: dict[str, Any], steps: list[Step]) -> None:
    Scene(**options).play(steps)


@pytest.mark.parametrize("freed,stopped", [
    pytest.param([(2, 1), (1, 5)], 2, id="an-idle-instance-of-its-tenant-first"),  # not the one freed last
    pytest.param([(1, 5)], 1, id="else-one-of-another-tenant"),
])
def test_an_inference_query_on_a_full_node_replaces(freed: list[tuple[int, int]], stopped: int) -> None:
    Scene(2).play([
        (("give", 5), ["Sp:1:b:cold_start", "I:5@1"]),
        (("give", 1), ["Sp:2:a:cold_start", "I:1@2"]),
        *[(("done", instance, task), [f"T:{task}"]) for instance, task in freed],
        (("query", 7, "a", True), [f"St:{stopped}", "Sp:3:a:query+torch", "Q:7@3"]),
    ])


# -- keeping instances -------------------------------------------------------------------------------
def busy_and_idle() -> Scene:
    """Instances 1 (tenant a) and 2 (tenant b), idle for 12 and 11 seconds at the next event, and 3
    (tenant a), busy."""
    scene = Scene(3)
    scene.play([
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 5), ["Sp:2:b:cold_start", "I:5@2"]),
        (("give", 6), ["Sp:3:a:cold_start", "I:6@3"]),
        (("done", 1, 1), ["T:1"]),
        (("done", 2, 5), ["T:5"]),
        (("wait", 10.0), []),
    ])
    return scene


@pytest.mark.parametrize("keep_warm,keep,stopped", [
    pytest.param(60.0, {}, [], id="none-idle-long-enough"),
    pytest.param(12.5, {}, [], id="idle-just-short-of-keep-warm"),
    pytest.param(12.0, {}, ["St:1"], id="idle-exactly-keep-warm"),
    pytest.param(11.5, {}, ["St:1"], id="idle-past-keep-warm"),
    pytest.param(0.0, {}, ["St:1", "St:2"], id="busy-instances-never-go"),
    pytest.param(0.0, {"b": 1}, ["St:1"], id="the-planner-keeps-one-warm"),
    pytest.param(0.0, {"a": 2, "b": 1}, [], id="the-planner-keeps-each-tenants"),
    pytest.param(0.0, {"b": 3}, ["St:1"], id="keeping-more-than-there-are"),
])
def test_expire(keep_warm: float, keep: dict[str, int], stopped: list[str]) -> None:
    scene = busy_and_idle()
    assert scene.run(("expire", keep_warm, keep)) == stopped
    assert sorted(scene.board.workers) == sorted({1, 2, 3} - {int(s[3:]) for s in stopped})


def test_a_prewarmed_instance_is_idle_from_its_start() -> None:
    """Scale to zero counts an instance's idle time from its start when it has run nothing."""
    Scene(2).play([
        (("warm", {"a": 1}), ["Sp:1:a:prewarm"]),
        (("expire", 60.0, {}), []),  # idle for one second
        (("wait", 60.0), []),
        (("expire", 60.0, {}), ["St:1"]),
    ])


@pytest.mark.parametrize("options,steps", [
    pytest.param({"max_instances": 3}, [
        (("warm", {"a": 2}), ["Sp:1:a:prewarm", "Sp:2:a:prewarm"]),
        (("give", 1), ["I:1@1"]),  # no cold start
        (("warm", {"a": 2}), []),  # it has two
        (("warm", {"a": 1, "b": 5}), ["Sp:3:b:prewarm"]),  # up to max_instances; none stopped
    ], id="the-planners-instances-start-ahead-of-the-load"),
    pytest.param({"max_instances": 3}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("warm", {"a": 2, "b": 1}), ["Sp:2:a:prewarm", "Sp:3:b:prewarm"]),  # busy instances count
    ], id="busy-instances-count-as-warm"),
    pytest.param({"max_instances": 3}, [
        (("give", 1), ["Sp:1:a:cold_start", "I:1@1"]),
        (("give", 3), []),  # waits for its producer's instance
        (("warm", {"a": 2}), ["Sp:2:a:prewarm", "I:3@2"]),  # until an idle one starts
    ], id="a-waiting-task-takes-a-prewarmed-instance"),
])
def test_warm(options: dict[str, Any], steps: list[Step]) -> None:
    Scene(**options).play(steps)


# -- what instances do -------------------------------------------------------------------------------
@pytest.mark.parametrize("events,counts", [
    pytest.param([], {}, id="none"),
    pytest.param([("give", 1), ("give", 5), ("give", 3)], {"leaf": 2}, id="a-waiting-task-has-no-instance"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 3), ("query", 7, "b", False), ("warm", {"a": 3})],
                 {"middle": 1, "query": 1, "idle": 1}, id="by-role-query-or-idle"),
    pytest.param([("give", 1), ("done", 1, 1), ("give", 3), ("done", 1, 3), ("give", 4)], {"top": 1}, id="a-top"),
    pytest.param([("give", 1), ("cancel", 1)], {"leaf": 1}, id="a-called-off-task-runs-until-acknowledged"),
])
def test_counts(events: list[Event], counts: dict[str, int]) -> None:
    scene = Scene(3)
    for event in events:
        scene.run(event)
    assert scene.board.counts() == {"leaf": 0, "middle": 0, "top": 0, "query": 0, "idle": 0, **counts}


def test_running_on_and_ready() -> None:
    scene = Scene(2)
    scene.run(("give", 1))
    board = scene.board
    assert (board.running_on(1, 1), board.running_on(2, 1), board.workers[1].ready) == (scene.tasks[1], None, False)
    board.ready(1)
    board.ready(9)  # an instance that went meanwhile
    assert board.workers[1].ready
    scene.run(("done", 1, 1))
    assert board.running_on(1, 1) is None
