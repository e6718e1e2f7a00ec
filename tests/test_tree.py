"""The node's aggregation tree as a pure state machine: events in, effects out (no processes)."""

from __future__ import annotations

import pytest

from lifl.node.tree import (
    OPEN, Cancel, Deliver, Drop, Forward, Input, Install, NotTheTop, Release, Resize, Start, Trees,
)
from lifl.cluster_types import Shard


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def update(n: int, samples: int = 1) -> Input:
    return Input(key(n), samples, 1, False)


def shard(round_id: int = 0, counts: dict[str, int] | None = None, *, finalized: bool = True, top: str | None = None,
          epoch: int = 0, dead: frozenset[str] = frozenset()) -> Shard:
    return Shard(round=round_id, finalized=finalized, counts=counts or {}, top=top, epoch=epoch, delivered=frozenset(),
                 dead=dead, lost={}, plan=None)


def kinds(effects: list) -> list[str]:
    """A compact spelling of effects: S:role, D:task, R:task=n, F:node@epoch, I:updates, C:task, X, Rel."""
    out = []
    for e in effects:
        if isinstance(e, Start):
            out.append(f"S:{e.task.role}{e.task.id}")
        elif isinstance(e, Deliver):
            out.append(f"D:{e.task}")
        elif isinstance(e, Resize):
            out.append(f"R:{e.task}={e.fan_in}")
        elif isinstance(e, Forward):
            out.append(f"F:{e.node}@{e.epoch}")
        elif isinstance(e, Install):
            out.append(f"I:{e.input.updates}")
        elif isinstance(e, Cancel):
            out.append(f"C:{e.task}")
        elif isinstance(e, Drop):
            out.append("X")
        elif isinstance(e, Release):
            out.append(f"Rel:{e.round}")
        else:  # an effect these tests do not know must not pass for none at all
            raise AssertionError(f"unexpected effect {e!r}")
    return out


def arrivals(t: Trees, n: int, fan_in: int = 2, job: str = "j", round_id: int = 0) -> list[list[str]]:
    return [kinds(t.accepted(job, round_id, 0, fan_in, update(i))) for i in range(n)]


@pytest.mark.parametrize("n,fan_in,expected", [
    # the middle (task 1) is created with the round; leaves as updates arrive
    (1, 2, [["S:middle1", "S:leaf2", "D:2"]]),
    (3, 2, [["S:middle1", "S:leaf2", "D:2"], ["D:2"], ["S:leaf3", "D:3"]]),
    (3, 1, [["S:middle1", "S:leaf2", "D:2"], ["S:leaf3", "D:3"], ["S:leaf4", "D:4"]]),
    (4, 3, [["S:middle1", "S:leaf2", "D:2"], ["D:2"], ["D:2"], ["S:leaf3", "D:3"]]),
])
def test_updates_fill_leaves_of_fan_in_I(n: int, fan_in: int, expected: list[list[str]]) -> None:
    t = Trees("a")
    assert arrivals(t, n, fan_in) == expected
    assert t.tasks[1].fan_in == OPEN  # the middle waits for the round to close


@pytest.mark.parametrize("n,fan_in,resizes", [
    (5, 2, ["R:4=1", "R:1=3"]),  # the last leaf got one of two; the middle has three leaves
    (4, 2, ["R:1=2"]),  # leaves full: only the middle learns its fan-in
    (1, 3, ["R:2=1", "R:1=1"]),
])
def test_closing_sizes_the_last_leaf_and_the_middle(n: int, fan_in: int, resizes: list[str]) -> None:
    t = Trees("a")
    arrivals(t, n, fan_in)
    assert kinds(t.sync("j", shard(counts={"a": n}))) == resizes
    assert kinds(t.sync("j", shard(counts={"a": n}))) == []  # level-based: repeating changes nothing


def test_close_learnt_before_the_last_update_waits_for_it() -> None:
    t = Trees("a")
    arrivals(t, 2)
    assert kinds(t.sync("j", shard(counts={"a": 3}))) == []  # the third is still on its way here
    assert kinds(t.accepted("j", 0, 0, 2, update(9))) == ["S:leaf3", "D:3", "R:3=1", "R:1=2"]


def test_a_close_that_undercounts_this_node_is_an_error() -> None:
    t = Trees("a")
    arrivals(t, 2)
    with pytest.raises(ValueError, match="acknowledged 2"):
        t.sync("j", shard(counts={"a": 1}))


def test_single_node_round_from_updates_to_install() -> None:
    t = Trees("a")
    arrivals(t, 3)
    t.sync("j", shard(counts={"a": 3}))
    assert kinds(t.sync("j", shard(counts={"a": 3}, top="a"))) == ["S:top4", "R:4=1"]
    assert kinds(t.result(2, Input(key(20), 2, 2, True))) == ["D:1"]  # leaf -> middle
    assert kinds(t.result(3, Input(key(30), 1, 1, False))) == ["D:1"]
    assert kinds(t.result(1, Input(key(10), 3, 3, True))) == ["D:4"]  # middle -> local top
    effects = t.result(4, Input(key(40), 3, 3, False))
    assert kinds(effects) == ["I:3"] and effects[0].version == 0
    for task in (2, 3, 1, 4):
        t.finished(task)
    assert kinds(t.sync("j", shard(1, {}, finalized=False))) == ["Rel:0"]  # the next round opened
    assert t.rounds == {} and t.tasks == {}


def test_a_middle_done_before_the_top_is_placed_waits_for_it() -> None:
    t = Trees("b")
    arrivals(t, 1, job="j")
    t.sync("j", shard(counts={"a": 2, "b": 1}))
    assert kinds(t.result(1, Input(key(1), 1, 1, False))) == []  # no top yet
    assert kinds(t.sync("j", shard(counts={"a": 2, "b": 1}, top="a"))) == ["F:a@0"]


def test_results_cross_to_the_top_node_and_duplicates_are_dropped() -> None:
    top, other = Trees("a"), Trees("b")
    arrivals(top, 2)
    arrivals(other, 1)
    s = shard(counts={"a": 2, "b": 1}, top="a")
    assert kinds(top.sync("j", s)) == ["R:1=1", "S:top3", "R:3=2"]  # two nodes take part
    assert kinds(other.sync("j", s)) == ["R:2=1", "R:1=1"]
    assert kinds(other.result(1, Input(key(5), 4, 1, False))) == ["F:a@0"]
    assert kinds(top.partial("j", 0, "b", 0, Input(key(6), 4, 1, False))) == ["D:3"]
    assert kinds(top.partial("j", 0, "b", 0, Input(key(7), 4, 1, False))) == ["X"]  # resent: once only
    with pytest.raises(NotTheTop):
        other.partial("j", 0, "a", 0, Input(key(8), 1, 1, True))  # b does not host the top
    with pytest.raises(NotTheTop):
        top.partial("j", 0, "b", 1, Input(key(8), 1, 1, True))  # another epoch's


def test_when_the_top_moves_results_are_sent_again() -> None:
    b = Trees("b")
    arrivals(b, 1)
    b.sync("j", shard(counts={"a": 3, "b": 1, "c": 2}, top="a"))
    assert kinds(b.result(1, Input(key(5), 1, 1, False))) == ["F:a@0"]
    assert kinds(b.sync("j", shard(counts={"a": 3, "b": 1, "c": 2}, top="a"))) == []  # sent once per epoch
    moved = shard(counts={"a": 0, "b": 1, "c": 2}, top="c", epoch=1, dead=frozenset({"a"}))
    assert kinds(b.sync("j", moved)) == ["F:c@1"]


def test_a_node_that_becomes_the_top_takes_its_own_result_in() -> None:
    c = Trees("c")
    arrivals(c, 2)
    c.sync("j", shard(counts={"a": 3, "b": 1, "c": 2}, top="a"))
    assert kinds(c.result(1, Input(key(5), 2, 2, True))) == ["F:a@0"]
    moved = shard(counts={"a": 0, "b": 1, "c": 2}, top="c", epoch=1, dead=frozenset({"a"}))
    assert kinds(c.sync("j", moved)) == ["S:top3", "D:3", "R:3=2"]
    assert kinds(c.partial("j", 0, "b", 1, Input(key(6), 1, 1, False))) == ["D:3"]


def test_the_top_shrinks_when_a_node_dies_before_its_result_arrives() -> None:
    a = Trees("a")
    arrivals(a, 2)
    a.sync("j", shard(counts={"a": 2, "b": 1, "c": 1}, top="a"))
    assert a.tasks[3].fan_in == 3
    assert kinds(a.sync("j", shard(counts={"a": 2, "b": 1, "c": 0}, top="a", dead=frozenset({"c"})))) == ["R:3=2"]


@pytest.mark.parametrize("event,expected", [
    ("moved on", ["C:2", "C:1", "Rel:0"]),
    ("declared dead", ["C:2", "C:1", "Rel:0"]),
])
def test_a_round_that_ends_elsewhere_is_called_off_here(event: str, expected: list[str]) -> None:
    t = Trees("a")
    arrivals(t, 1)
    s = shard(1, {}, finalized=False) if event == "moved on" else shard(0, {"a": 0}, finalized=False, dead=frozenset({"a"}))
    assert kinds(t.sync("j", s)) == expected
    assert t.rounds == {}


def test_an_update_of_a_newer_round_ends_the_old_one() -> None:
    t = Trees("a")
    arrivals(t, 1, round_id=0)
    assert kinds(t.accepted("j", 1, 0, 2, update(5))) == ["C:2", "C:1", "Rel:0", "S:middle3", "S:leaf4", "D:4"]
    assert kinds(t.accepted("j", 0, 0, 2, update(6))) == ["X"]  # a straggler of the ended round


def test_jobs_have_trees_of_their_own() -> None:
    t = Trees("a")
    t.accepted("x", 0, 0, 2, update(1))
    t.accepted("y", 4, 2, 2, update(2))
    assert set(t.rounds) == {"x", "y"} and t.rounds["y"].round == 4
    assert kinds(t.end("x", "gone")) == ["C:2", "C:1", "Rel:0"] and set(t.rounds) == {"y"}


def test_producers_are_the_unfinished_tasks_feeding_a_task() -> None:
    """What a task waiting for an instance may wait for (the agent's reuse): its own producers,
    never a task that waits for it."""
    t = Trees("n1")
    arrivals(t, 3)  # middle 1, leaves 2 and 3
    kinds(t.sync("j", shard(counts={"n1": 3}, top="n1")))  # the top: task 4
    assert [t.producers(i) for i in (1, 2, 3, 4)] == [[2, 3], [], [], [1]]
    t.finished(2)
    assert t.producers(1) == [3]
    kinds(t.result(3, Input(key(90), 2, 1, True)))
    t.finished(3)
    assert t.producers(1) == [] and t.producers(4) == [1]
    t.finished(1)
    assert t.producers(4) == [] and t.producers(99) == []


# -- tensor shards: a lane per shard -------------------------------------------------------------------
def test_a_sharded_round_gives_every_update_to_a_leaf_of_each_shard() -> None:
    t = Trees("a")
    first = t.accepted("j", 0, 0, 2, update(0), shards=2)
    assert kinds(first) == ["S:middle1", "S:middle2", "S:leaf3", "D:3", "S:leaf4", "D:4"]
    assert [e.shared for e in first if isinstance(e, Deliver)] == [False, True]  # one object, a reference each
    assert [e.task.shard for e in first if isinstance(e, Start)] == [0, 1, 0, 1]
    assert kinds(t.accepted("j", 0, 0, 2, update(1), shards=2)) == ["D:3", "D:4"]
    assert kinds(t.accepted("j", 0, 0, 2, update(2), shards=2)) == ["S:leaf5", "D:5", "S:leaf6", "D:6"]
    assert kinds(t.sync("j", shard(counts={"a": 3}))) == ["R:5=1", "R:1=2", "R:6=1", "R:2=2"]
    assert kinds(t.sync("j", shard(counts={"a": 3}, top="a"))) == ["S:top7", "S:top8", "R:7=1", "R:8=1"]
    assert t.producers(1) == [3, 5] and t.producers(2) == [4, 6] and t.producers(8) == [2]


def test_a_sharded_round_installs_once_every_shard_wrote_its_slice() -> None:
    t = Trees("a")
    for i in range(2):
        t.accepted("j", 0, 0, 2, update(i), shards=3)
    t.sync("j", shard(counts={"a": 2}, top="a"))
    tops = [task.id for task in t.tasks.values() if task.role == "top"]
    for middle, top in zip((1, 2, 3), tops):
        leaf = t.producers(middle)[0]
        assert kinds(t.result(leaf, Input(key(100 + leaf), 2, 2, True))) == [f"D:{middle}"]
        assert kinds(t.result(middle, Input(key(200 + middle), 2, 2, True))) == [f"D:{top}"]
    model = Input(key(999), 2, 2, False)  # every top wrote its slice into this one object
    assert t.result(tops[0], model) == [] and t.result(tops[2], model) == []
    effects = t.result(tops[1], model)
    assert kinds(effects) == ["I:2"] and effects[0].input == model


def test_shards_that_disagree_on_the_model_are_an_error() -> None:
    t = Trees("a")
    t.accepted("j", 0, 0, 1, update(0), shards=2)
    t.sync("j", shard(counts={"a": 1}, top="a"))
    tops = [task.id for task in t.tasks.values() if task.role == "top"]
    t.result(tops[0], Input(key(1), 1, 1, False))
    with pytest.raises(ValueError, match="wrote different models"):
        t.result(tops[1], Input(key(2), 1, 1, False))


def test_a_sharded_round_whose_top_is_elsewhere_is_an_error() -> None:
    t = Trees("b")
    t.accepted("j", 0, 0, 1, update(0), shards=2)
    t.sync("j", shard(counts={"a": 1, "b": 1}))
    t.result(3, Input(key(3), 1, 1, False))
    t.result(1, Input(key(1), 1, 1, False))
    with pytest.raises(ValueError, match="tensor shards, which aggregate on one node"):
        t.sync("j", shard(counts={"a": 1, "b": 1}, top="a"))


def test_ending_a_sharded_round_cancels_every_lane() -> None:
    t = Trees("a")
    t.accepted("j", 0, 0, 2, update(0), shards=2)
    assert kinds(t.end("j", "gone")) == ["C:3", "C:1", "C:4", "C:2", "Rel:0"]
    assert t.tasks == {}


def test_a_split_round_has_its_tops_on_every_node_fed_by_that_node_alone() -> None:
    """A job split across nodes (lifl.shards.split_record): each node's lanes are its own shards,
    its tops are here whatever the shard names, each of fan-in 1, and nothing is forwarded."""
    t = Trees("b")
    for i in range(2):
        t.accepted("j", 0, 0, 2, update(i), shards=2)
    counts = {"a": 2, "b": 2, "c": 2}  # every node took its part of both updates
    assert kinds(t.sync("j", shard(counts=counts), own_top=True)) == ["R:1=1", "R:2=1", "S:top5", "S:top6", "R:5=1", "R:6=1"]
    assert kinds(t.sync("j", shard(counts=counts, top="a"), own_top=True)) == []  # a top elsewhere is not this job's
    for middle, top in ((1, 5), (2, 6)):
        leaf = t.producers(middle)[0]
        assert kinds(t.result(leaf, Input(key(100 + leaf), 2, 2, True))) == [f"D:{middle}"]
        assert kinds(t.result(middle, Input(key(200 + middle), 2, 2, True))) == [f"D:{top}"]  # here, never forwarded
    model = Input(key(999), 2, 2, False)
    assert t.result(5, model) == [] and kinds(t.result(6, model)) == ["I:2"]
