"""Where a round's results go once they exist (``lifl.node.installs``), as pure state machines
with the clock as an argument.

``Checkpoints``: a round's model whose checkpoint failed is written again after the back-offs of
``CHECKPOINT_RETRY`` (the last repeating), counted per model (a new round's model starts over);
``due`` hands it out once and marks it in progress; ``written`` forgets it; ``give_up`` forgets
only the job's current entry. ``Forwards``: a partial result on its way to the top on another
node; a new one supersedes the same round's; ``answered`` (delivered, or failed); ``failed`` waits
the back-offs of ``FORWARD_RETRY`` (the last repeating); ``forwarder_gone`` makes what was being
sent due at once; ``due(now, wanted)`` forgets what is no longer wanted; ``release_round``.
Each table row is a list of timed events with what each must answer.
"""

from __future__ import annotations

from typing import Any

import pytest

from lifl.node.installs import (
    CHECKPOINT_RETRY, FAILED, FORWARD_RETRY, Checkpoints, FailedCheckpoint, Forwards, OutgoingPartial,
    backoff,
)
from lifl.node.tree import Forward, Input, Install

Event = tuple[Any, ...]
Step = tuple[float, Event, list[str]]  # (the time, the event, what it answers)

RESULT = Input(bytes(16), 10, 4, True)


@pytest.mark.parametrize("delays,attempts,wait", [
    pytest.param(CHECKPOINT_RETRY, 1, 0.5, id="checkpoint-first"),
    pytest.param(CHECKPOINT_RETRY, 4, 5.0, id="checkpoint-fourth"),
    pytest.param(CHECKPOINT_RETRY, 5, 10.0, id="checkpoint-last"),
    pytest.param(CHECKPOINT_RETRY, 6, 10.0, id="checkpoint-past-the-last"),
    pytest.param(CHECKPOINT_RETRY, 1000, 10.0, id="checkpoint-far-past-the-last"),
    pytest.param(FORWARD_RETRY, 1, 0.2, id="forward-first"),
    pytest.param(FORWARD_RETRY, 4, 2.0, id="forward-last"),
    pytest.param(FORWARD_RETRY, 5, 2.0, id="forward-past-the-last"),
])
def test_backoff(delays: tuple[float, ...], attempts: int, wait: float) -> None:
    assert backoff(delays, attempts) == wait


# -- checkpoints -------------------------------------------------------------------------------------
INSTALLS = {  # a round's model, by name: j0 and j1 are job j's rounds 0 and 1
    "j0": Install("j", 0, 0, RESULT),
    "j1": Install("j", 1, 1, RESULT),
    "k0": Install("k", 0, 0, RESULT),
}


class CheckpointBook:
    def __init__(self) -> None:
        self.checkpoints = Checkpoints()
        self.entries: dict[str, FailedCheckpoint] = {}  # the latest entry of each model

    def run(self, now: float, event: Event) -> list[str]:
        """Apply ``event`` at ``now``: a failure's entry (model#attempts+wait), the models due,
        whether give_up forgot the entry."""
        c = self.checkpoints
        match event:
            case ("failed", name):
                entry = self.entries[name] = c.write_failed(INSTALLS[name], now)
                return [f"{name}#{entry.attempts}+{entry.next_try - now:g}"]
            case ("due",):
                return [next(n for n, i in INSTALLS.items() if i is f.install) for f in c.due(now)]
            case ("written", job):
                c.written(job)
                return []
            case ("give_up", name):
                return ["gave up"] if c.give_up(self.entries[name]) else []
        raise AssertionError(f"unknown event {event!r}")


def play_checkpoints(steps: list[Step]) -> None:
    book = CheckpointBook()
    assert [book.run(now, event) for now, event, _ in steps] == [expected for _, _, expected in steps]


@pytest.mark.parametrize("steps", [
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (0.4, ("due",), []),
                  (0.5, ("due",), ["j0"]),  # at its time
                  (0.6, ("due",), []),  # in progress: not handed out again
                  (99, ("due",), [])], id="due-after-its-back-off-once"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (1, ("due",), ["j0"]),
                  (2, ("failed", "j0"), ["j0#2+1"]),
                  (3, ("due",), ["j0"]),
                  (3, ("failed", "j0"), ["j0#3+2"]),
                  (3, ("failed", "j0"), ["j0#4+5"]),
                  (3, ("failed", "j0"), ["j0#5+10"]),
                  (3, ("failed", "j0"), ["j0#6+10"]),  # the last back-off repeats
                  (3, ("failed", "j0"), ["j0#7+10"]),
                  (12.9, ("due",), []),
                  (13, ("due",), ["j0"])], id="the-back-off-grows-to-its-last"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (0, ("failed", "j0"), ["j0#2+1"]),
                  (5, ("failed", "j1"), ["j1#1+0.5"]),  # the next round's model counts afresh
                  (5.5, ("due",), ["j1"])], id="a-new-rounds-model-replaces-the-jobs-entry"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (0, ("failed", "k0"), ["k0#1+0.5"]),
                  (0, ("failed", "k0"), ["k0#2+1"]),
                  (0.5, ("due",), ["j0"]),
                  (1, ("due",), ["k0"])], id="jobs-have-entries-of-their-own"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (0.2, ("written", "j"), []),
                  (1, ("due",), []),
                  (2, ("failed", "j0"), ["j0#1+0.5"]),  # written meanwhile: counted afresh
                  (3, ("written", "k"), [])], id="written-forgets-it"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (1, ("give_up", "j0"), ["gave up"]),
                  (2, ("due",), []),
                  (3, ("give_up", "j0"), [])], id="given-up-it-is-forgotten"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (1, ("failed", "j1"), ["j1#1+0.5"]),
                  (2, ("give_up", "j0"), []),  # not the job's current entry
                  (2, ("due",), ["j1"])], id="give-up-only-the-current-entry"),
    pytest.param([(0, ("failed", "j0"), ["j0#1+0.5"]),
                  (1, ("written", "j"), []),
                  (2, ("give_up", "j0"), [])], id="give-up-after-written"),
])
def test_checkpoints(steps: list[Step]) -> None:
    play_checkpoints(steps)


def test_due_hands_out_the_entry_marked_in_progress() -> None:
    book = CheckpointBook()
    book.run(0, ("failed", "j0"))
    (entry,) = book.checkpoints.due(1)
    assert entry is book.entries["j0"] and entry.next_try == float("inf") and entry.attempts == 1


# -- forwards ----------------------------------------------------------------------------------------
FORWARDS = {  # a partial result to forward, by name: jb (job j's round 0) to node b, jc (the same round) to c
    "jb": Forward("j", 0, "b", 0, RESULT),
    "jc": Forward("j", 0, "c", 1, RESULT),
    "kb": Forward("k", 0, "b", 0, RESULT),
}
WANTED = {("j", 0): ("b", 0), ("k", 0): ("b", 0)}  # where this node's results were last sent


class ForwardBook:
    def __init__(self) -> None:
        self.forwards = Forwards()
        self.outs: dict[str, OutgoingPartial] = {}

    def name(self, out: OutgoingPartial) -> str:
        return next(n for n, o in self.outs.items() if o is out)

    def run(self, now: float, event: Event) -> list[str]:
        """Apply ``event`` at ``now``: the partial's state (state#attempts, and @time of a failed one's
        next try), the partials due, or "unknown" (an answer for a partial no longer wanted)."""
        f = self.forwards
        match event:
            case ("new", name):
                self.outs[name] = f.new(FORWARDS[name])
                return [self.spell(self.outs[name])]
            case ("sending", name):
                f.sending(self.outs[name])
                return []
            case ("answered", name, delivered):
                out = f.answered(self.outs[name].ref, delivered, now)
                return [self.spell(out) if out is not None else "unknown"]
            case ("failed", name):
                f.failed(self.outs[name], now)
                return [self.spell(self.outs[name])]
            case ("forwarder_gone",):
                f.forwarder_gone(now)
                return [f"{n}:{self.spell(o)}" for n, o in self.outs.items() if o.ref in f.outgoing]
            case ("due", wanted):
                return [self.name(o) for o in f.due(now, wanted)]
            case ("release_round", job, round_id):
                f.release_round(job, round_id)
                return []
            case ("outgoing",):
                return [n for n, o in self.outs.items() if f.outgoing.get(o.ref) is o]
        raise AssertionError(f"unknown event {event!r}")

    @staticmethod
    def spell(out: OutgoingPartial) -> str:
        return f"{out.state}#{out.attempts}" + (f"@{out.next_try:g}" if out.state == FAILED else "")


def play_forwards(steps: list[Step]) -> None:
    book = ForwardBook()
    assert [book.run(now, event) for now, event, _ in steps] == [expected for _, _, expected in steps]


@pytest.mark.parametrize("steps", [
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []),
                  (1, ("answered", "jb", True), ["done#1"]),
                  (9, ("due", WANTED), []),  # delivered: never sent again
                  (9, ("outgoing",), ["jb"])], id="delivered-it-is-done"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []),
                  (10, ("answered", "jb", False), ["failed#1@10.2"]),
                  (10.1, ("due", WANTED), []),
                  (10.2, ("due", WANTED), ["jb"]),  # at its time
                  (10.2, ("sending", "jb"), []),
                  (10.3, ("due", WANTED), []),  # being sent again
                  (11, ("answered", "jb", False), ["failed#2@11.5"]),
                  (11.5, ("due", WANTED), ["jb"])], id="refused-it-is-sent-again-after-its-back-off"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#1@0.2"]),
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#2@0.5"]),
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#3@1"]),
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#4@2"]),
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#5@2"]),  # the last back-off repeats
                  (0, ("sending", "jb"), []), (0, ("failed", "jb"), ["failed#6@2"])], id="the-back-off-grows-to-its-last"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (5, ("failed", "jb"), ["failed#0@5.2"])], id="failed-before-it-was-sent-waits-the-first-back-off"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []),
                  (0, ("new", "kb"), ["sending#0"]),
                  (0, ("sending", "kb"), []),
                  (1, ("answered", "kb", True), ["done#1"]),
                  (7, ("forwarder_gone",), ["jb:failed#1@7", "kb:done#1"]),  # what was being sent did not arrive
                  (7, ("due", WANTED), ["jb"])], id="the-forwarder-gone-makes-what-it-was-sending-due-at-once"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []),
                  (0, ("new", "kb"), ["sending#0"]),
                  (1, ("answered", "kb", False), ["failed#0@1.2"]),
                  (2, ("forwarder_gone",), ["jb:failed#1@2", "kb:failed#0@1.2"])], id="a-failed-ones-back-off-stays"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("sending", "jb"), []),
                  (0, ("new", "jc"), ["sending#0"]),  # the top moved: the same round's result goes there instead
                  (1, ("answered", "jb", True), ["unknown"]),
                  (1, ("outgoing",), ["jc"])], id="a-new-one-supersedes-the-same-rounds"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("new", "kb"), ["sending#0"]),
                  (0, ("outgoing",), ["jb", "kb"])], id="another-jobs-is-kept"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("new", "kb"), ["sending#0"]),
                  (1, ("failed", "jb"), ["failed#0@1.2"]),
                  (1, ("failed", "kb"), ["failed#0@1.2"]),
                  (2, ("due", {("k", 0): ("b", 0)}), ["kb"]),  # job j's round is over here
                  (2, ("outgoing",), ["kb"]),
                  (3, ("answered", "jb", False), ["unknown"])], id="due-forgets-a-round-not-wanted"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (1, ("failed", "jb"), ["failed#0@1.2"]),
                  (2, ("due", {("j", 0): ("b", 1)}), []),  # another epoch's top
                  (2, ("outgoing",), [])], id="due-forgets-one-for-another-epoch"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (1, ("failed", "jb"), ["failed#0@1.2"]),
                  (2, ("due", {("j", 0): ("c", 0)}), []),  # another node's top
                  (2, ("outgoing",), [])], id="due-forgets-one-for-another-node"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("answered", "jb", True), ["done#0"]),
                  (2, ("due", {("j", 0): None}), []),  # the top moved here: nothing is sent
                  (2, ("outgoing",), [])], id="due-forgets-one-not-sent-anywhere-now"),
    pytest.param([(0, ("new", "jb"), ["sending#0"]),
                  (0, ("new", "kb"), ["sending#0"]),
                  (1, ("release_round", "j", 0), []),
                  (1, ("release_round", "k", 1), []),  # another round
                  (1, ("outgoing",), ["kb"]),
                  (2, ("answered", "jb", True), ["unknown"])], id="release-round"),
])
def test_forwards(steps: list[Step]) -> None:
    play_forwards(steps)
