"""The node's book of uploads (``lifl.node.uploads.Uploads``) as a pure state machine.

Each table row is a list of events on one book (admit a blob, take it, abort it, a gateway
connection gone, an update done, the budget checked, a model upload begun) with what each must
answer: its effects (``ReleaseUpload``, ``GiveBackSlot``), the upload handed over, or the error's
code. Covered: the in-flight count per job and ``inflight_budget`` (below, at and past it),
what counts as in flight and until when, ``take`` (holder, kind), ``abort`` and ``dropped_by``
with their effects by kind, and one model upload at a time per job.
"""

from __future__ import annotations

from typing import Any

import pytest

from lifl.errors import LiflError
from lifl.node.uploads import MODEL, PARTIAL, REPLICA, UPDATE, GiveBackSlot, ReleaseUpload, Upload, Uploads

Event = tuple[Any, ...]
Step = tuple[Event, list[str]]

A, B = "gateway-a", "gateway-b"  # two gateway connections


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def number(k: bytes) -> int:
    return int.from_bytes(k, "little")


class Book:
    """An ``Uploads`` and the events of the tables. Blobs are named by numbers; an update's round is 3."""

    def __init__(self) -> None:
        self.uploads = Uploads()
        self.admitted: dict[int, Upload] = {}

    def run(self, event: Event) -> list[str]:
        """Apply ``event``: its effects (Rel:key, Slot:job/round/token:reason), the upload taken (took:key),
        the job whose update is done, "ok", or the refusal's code (!code)."""
        u = self.uploads
        try:
            match event:
                case ("admit", n, kind, job, holder):
                    self.admitted[n] = Upload(job, kind, holder, version=2, round=3, slot=f"t{n}")
                    u.add(key(n), self.admitted[n])
                    return []
                case ("take", holder, n, kind):
                    return [f"took:{n}" if u.take(holder, key(n), kind) is self.admitted[n] else "took:another"]
                case ("abort", holder, n):
                    return self.spell(u.abort(holder, key(n), "client_abort"))
                case ("gone", holder):
                    return self.spell(u.dropped_by(holder))
                case ("done", n):
                    return [str(u.update_done(key(n)))]
                case ("budget", job, budget):
                    u.check_budget(job, budget, "n1")
                    return ["ok"]
                case ("model", job):
                    u.begin_model(job)
                    return ["ok"]
        except LiflError as e:
            return [f"!{e.code}"]
        raise AssertionError(f"unknown event {event!r}")

    def spell(self, effects: list[ReleaseUpload | GiveBackSlot]) -> list[str]:
        out = []
        for e in effects:
            if isinstance(e, ReleaseUpload):
                out.append(f"Rel:{number(e.key)}" + ("" if e.upload is self.admitted[number(e.key)] else "(another upload)"))
            elif isinstance(e, GiveBackSlot):
                out.append(f"Slot:{e.job}/{e.round}/{e.slot}:{e.reason}")
            else:
                raise AssertionError(f"unexpected effect {e!r}")
        return out

    def play(self, steps: list[Step]) -> None:
        assert [self.run(event) for event, _ in steps] == [expected for _, expected in steps]


def admitted(*blobs: tuple[int, str, str, str]) -> list[Step]:
    """Steps admitting ``(number, kind, job, holder)`` blobs."""
    return [(("admit", *blob), []) for blob in blobs]


@pytest.mark.parametrize("steps", [
    pytest.param([(("budget", "j", 1), ["ok"])], id="nothing-in-flight"),
    pytest.param([(("budget", "j", 0), ["!inflight_budget"])], id="a-budget-of-zero"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, UPDATE, "j", B)),
                  (("budget", "j", 3), ["ok"])], id="below-the-budget"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, UPDATE, "j", B)),
                  (("budget", "j", 2), ["!inflight_budget"])], id="at-the-budget"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, UPDATE, "j", B), (3, UPDATE, "j", A)),
                  (("budget", "j", 2), ["!inflight_budget"])], id="past-the-budget"),
    pytest.param([*admitted((1, UPDATE, "k", A), (2, UPDATE, "k", A)),
                  (("budget", "j", 1), ["ok"])], id="another-jobs-updates-do-not-count"),
    pytest.param([*admitted((1, MODEL, "j", A), (2, PARTIAL, "j", A), (3, REPLICA, "j", A)),
                  (("budget", "j", 1), ["ok"])], id="models-partials-and-replicas-are-not-updates"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, UPDATE, "j", A)),
                  (("take", A, 1, UPDATE), ["took:1"]),
                  (("budget", "j", 2), ["!inflight_budget"])], id="an-update-handed-over-is-still-in-flight"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, UPDATE, "j", A)),
                  (("done", 1), ["j"]),
                  (("budget", "j", 2), ["ok"]),
                  (("done", 1), ["None"]),  # once only
                  (("budget", "j", 1), ["!inflight_budget"])], id="an-update-done-leaves-the-budget"),
    pytest.param([*admitted((1, UPDATE, "j", A), (2, PARTIAL, "j", A)),
                  (("done", 2), ["None"]),  # a partial sum is no client update
                  (("done", 9), ["None"]),
                  (("budget", "j", 1), ["!inflight_budget"])], id="only-updates-are-done"),
    pytest.param([*admitted((1, UPDATE, "j", A)),
                  (("abort", A, 1), ["Rel:1", "Slot:j/3/t1:client_abort"]),
                  (("budget", "j", 1), ["!inflight_budget"]),  # until its object is released (update_done)
                  (("done", 1), ["j"]),
                  (("budget", "j", 1), ["ok"])], id="an-aborted-update-is-in-flight-until-done"),
])
def test_in_flight_budget(steps: list[Step]) -> None:
    Book().play(steps)


@pytest.mark.parametrize("steps", [
    pytest.param([*admitted((1, UPDATE, "j", A)),
                  (("take", A, 1, UPDATE), ["took:1"]),
                  (("take", A, 1, UPDATE), ["!no_such_upload"]),  # it is no longer an upload
                  (("abort", A, 1), ["!no_such_upload"])], id="an-upload-is-taken-once"),
    pytest.param([*admitted((1, UPDATE, "j", A)),
                  (("take", B, 1, UPDATE), ["!no_such_upload"]),  # another connection's
                  (("abort", B, 1), ["!no_such_upload"]),
                  (("take", A, 1, UPDATE), ["took:1"])], id="only-by-its-connection"),
    pytest.param([*admitted((1, PARTIAL, "j", A)),
                  (("take", A, 1, UPDATE), ["!bad_request"]),
                  (("take", A, 1, PARTIAL), ["took:1"])], id="only-as-what-it-is"),
    pytest.param([(("take", A, 1, UPDATE), ["!no_such_upload"])], id="an-unknown-upload"),
])
def test_take(steps: list[Step]) -> None:
    Book().play(steps)


@pytest.mark.parametrize("kind,effects", [
    pytest.param(UPDATE, ["Rel:1", "Slot:j/3/t1:client_abort"], id="an-update-gives-its-rounds-slot-back"),
    pytest.param(MODEL, ["Rel:1"], id="a-model"),
    pytest.param(PARTIAL, ["Rel:1"], id="a-partial"),
    pytest.param(REPLICA, ["Rel:1"], id="a-replica"),
])
def test_abort(kind: str, effects: list[str]) -> None:
    Book().play([*admitted((1, kind, "j", A)), (("abort", A, 1), effects), (("take", A, 1, kind), ["!no_such_upload"])])


def test_a_connection_gone_drops_what_it_was_receiving() -> None:
    Book().play([
        *admitted((1, UPDATE, "j", A), (2, UPDATE, "j", B), (3, PARTIAL, "k", A), (4, UPDATE, "k", A), (5, MODEL, "m", A)),
        (("gone", A), ["Rel:1", "Slot:j/3/t1:connection_lost", "Rel:3", "Rel:4", "Slot:k/3/t4:connection_lost", "Rel:5"]),
        (("gone", A), []),
        (("take", B, 2, UPDATE), ["took:2"]),  # the other connection's stays
    ])


@pytest.mark.parametrize("steps", [
    pytest.param([(("model", "j"), ["ok"]), (("model", "j"), ["!model_upload_in_progress"])], id="one-at-a-time"),
    pytest.param([(("model", "j"), ["ok"]), (("model", "k"), ["ok"])], id="per-job"),
    pytest.param([(("model", "j"), ["ok"]), *admitted((1, MODEL, "j", A)),
                  (("take", A, 1, MODEL), ["took:1"]),
                  (("model", "j"), ["ok"])], id="the-next-once-it-is-handed-over"),
    pytest.param([(("model", "j"), ["ok"]), *admitted((1, MODEL, "j", A)),
                  (("abort", A, 1), ["Rel:1"]),
                  (("model", "j"), ["ok"])], id="the-next-once-it-is-aborted"),
    pytest.param([(("model", "j"), ["ok"]), *admitted((1, MODEL, "j", A)),
                  (("gone", A), ["Rel:1"]),
                  (("model", "j"), ["ok"])], id="the-next-once-its-connection-is-gone"),
    pytest.param([(("model", "j"), ["ok"]), *admitted((1, MODEL, "j", A), (2, UPDATE, "j", A)),
                  (("take", A, 2, UPDATE), ["took:2"]),
                  (("model", "j"), ["!model_upload_in_progress"])], id="not-once-another-upload-of-the-job-ends"),
])
def test_model_uploads_one_at_a_time_per_job(steps: list[Step]) -> None:
    Book().play(steps)
