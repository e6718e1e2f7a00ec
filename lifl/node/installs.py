"""Where a round's results go once they exist, as pure state machines with the clock as an
argument: the top's model on its way to becoming the next version (a checkpoint first, written
again after a back-off when it fails), and this node's partial result on its way to the top on
another node (sent again after a back-off until it arrives, or the round moves on).

The agent applies what these decide (write a checkpoint, ask the gateway to stream a partial)
and reports back what happened; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from lifl.node import tree

CHECKPOINT_RETRY = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds before writing a failed checkpoint again; the last repeats
FORWARD_RETRY = (0.2, 0.5, 1.0, 2.0)  # seconds before resending a partial that did not arrive; the last repeats


def backoff(delays: tuple[float, ...], attempts: int) -> float:
    """The wait before attempt ``attempts + 1`` (``attempts`` >= 1 have failed)."""
    return delays[min(attempts, len(delays)) - 1]


@dataclass(eq=False)
class FailedCheckpoint:
    """A round's model whose checkpoint could not be written: it waits, unseen, to be written again."""

    install: tree.Install
    attempts: int
    next_try: float  # on the caller's monotonic clock; inf while a write is in progress


class Checkpoints:
    """Each job's model whose checkpoint failed (one at a time: a job's rounds are sequential)."""

    def __init__(self) -> None:
        self.failed: dict[str, FailedCheckpoint] = {}

    def write_failed(self, install: tree.Install, now: float) -> FailedCheckpoint:
        before = self.failed.get(install.job)
        attempts = before.attempts + 1 if before is not None and before.install is install else 1
        entry = self.failed[install.job] = FailedCheckpoint(install, attempts, now + backoff(CHECKPOINT_RETRY, attempts))
        return entry

    def written(self, job: str) -> None:
        self.failed.pop(job, None)

    def due(self, now: float) -> list[FailedCheckpoint]:
        """The checkpoints to write again now (each marked in progress until it reports back)."""
        due = [f for f in self.failed.values() if f.next_try <= now]
        for f in due:
            f.next_try = float("inf")
        return due

    def give_up(self, entry: FailedCheckpoint) -> bool:
        """The round moved on without this model (abandoned past its deadline): forget it;
        whether it was still the job's pending one."""
        if self.failed.get(entry.install.job) is not entry:
            return False
        del self.failed[entry.install.job]
        return True


SENDING, FAILED, DONE = "sending", "failed", "done"


@dataclass(eq=False)
class OutgoingPartial:
    """This node's result of a round on its way to the top on another node."""

    ref: int
    job: str
    round: int
    node: str
    epoch: int
    input: tree.Input
    state: str = SENDING
    attempts: int = 0
    next_try: float = 0.0


class Forwards:
    """Partial results being forwarded, by reference (what the gateway's answer names)."""

    def __init__(self) -> None:
        self.outgoing: dict[int, OutgoingPartial] = {}
        self._refs = count(1)

    def new(self, forward: tree.Forward) -> OutgoingPartial:
        """A result to send (it supersedes one of the same round sent to a top that moved)."""
        self.release_round(forward.job, forward.round)
        out = OutgoingPartial(next(self._refs), forward.job, forward.round, forward.node, forward.epoch, forward.input)
        self.outgoing[out.ref] = out
        return out

    def sending(self, out: OutgoingPartial) -> None:
        out.state, out.attempts = SENDING, out.attempts + 1

    def answered(self, ref: int, delivered: bool, now: float) -> OutgoingPartial | None:
        """The gateway's answer for ``ref``: the partial (None if it is no longer wanted)."""
        out = self.outgoing.get(ref)
        if out is None:
            return None
        if delivered:
            out.state = DONE
        else:
            self.failed(out, now)
        return out

    def failed(self, out: OutgoingPartial, now: float) -> None:
        out.state, out.next_try = FAILED, now + backoff(FORWARD_RETRY, max(out.attempts, 1))

    def forwarder_gone(self, now: float) -> None:
        """The gateway's forwarding connection closed: what it was sending did not arrive."""
        for out in self.outgoing.values():
            if out.state == SENDING:
                out.state, out.next_try = FAILED, now

    def due(self, now: float, wanted: dict[tuple[str, int], tuple[str, int] | None]) -> list[OutgoingPartial]:
        """Failed partials to send again now. ``wanted``: for each round this node takes part in,
        the (node, epoch) its result was last sent to; a partial for anything else is forgotten
        (the top moved here, or to another epoch's node)."""
        for ref in [r for r, o in self.outgoing.items() if wanted.get((o.job, o.round)) != (o.node, o.epoch)]:
            del self.outgoing[ref]
        return [o for o in self.outgoing.values() if o.state == FAILED and o.next_try <= now]

    def release_round(self, job: str, round_id: int) -> None:
        for ref in [r for r, o in self.outgoing.items() if (o.job, o.round) == (job, round_id)]:
            del self.outgoing[ref]
