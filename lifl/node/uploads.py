"""Blobs on their way in, as a pure book: what a gateway connection is receiving into which
object, and how many client updates each job has in flight on this node.

A gateway asks for an object to receive a blob into (``admit``: a client update, a job's
initial model, another node's partial result, or a replica of a model held elsewhere) and
then hands it over (``take``), or gives it back (``abort``), or goes away with it
(``dropped_by``). A client update stays *in flight* from its admission until it is aggregated
or let go (``update_done``), and a job has at most its ``inflight_budget`` in flight here.

Nothing here does I/O: dropping an upload returns the effects the agent applies (release the
object, give the round's slot back in Redis, count the refusal).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from lifl.errors import BadRequest, Conflict, NotFound, Overloaded

UPDATE, MODEL, PARTIAL, REPLICA = "update", "model", "partial", "replica"
NO_MODEL = -1


@dataclass(eq=False)
class Upload:
    job: str
    kind: str  # UPDATE, MODEL, PARTIAL or REPLICA
    holder: Hashable  # the gateway connection receiving it
    version: int = NO_MODEL  # an update's round's version, a replica's version
    round: int = -1
    epoch: int = 0
    from_node: str = ""
    base: int = NO_MODEL  # an update's base version: older than ``version`` in fedbuff jobs
    slot: str = ""  # an update's token: its round slot in Redis, given back (or accepted) once


# -- effects -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReleaseUpload:
    """Let go of the upload's object (and, for an input of a round, what the round reserved for it)."""

    key: bytes
    upload: Upload


@dataclass(frozen=True)
class GiveBackSlot:
    """An update will not be counted: its round's slot goes back in Redis, and the refusal is counted."""

    job: str
    slot: str
    round: int
    reason: str


Effect = ReleaseUpload | GiveBackSlot


class Uploads:
    def __init__(self) -> None:
        self.records: dict[bytes, Upload] = {}
        self.in_flight: dict[bytes, str] = {}  # client updates admitted here and not aggregated yet -> job
        self.counts: dict[str, int] = {}  # job -> updates in flight here
        self.model_uploads: set[str] = set()  # jobs whose initial model is being received

    def check_budget(self, job: str, budget: int, node: str) -> None:
        """Refuse a new update of ``job`` if it has ``budget`` in flight here already."""
        have = self.counts.get(job, 0)
        if have >= budget:
            raise Overloaded(f"job {job!r} has {have} updates in flight on node {node}, its budget", code="inflight_budget")

    def begin_model(self, job: str) -> None:
        if job in self.model_uploads:
            raise Conflict(f"the model of job {job!r} is being uploaded already", code="model_upload_in_progress")
        self.model_uploads.add(job)

    def add(self, key: bytes, upload: Upload) -> None:
        self.records[key] = upload
        if upload.kind == UPDATE:
            self.in_flight[key] = upload.job
            self.counts[upload.job] = self.counts.get(upload.job, 0) + 1

    def take(self, holder: Hashable, key: bytes, kind: str) -> Upload:
        """The upload ``key`` of ``holder``, handed over complete (it is no longer an upload)."""
        upload = self.records.get(key)
        if upload is None or upload.holder != holder:
            raise NotFound(f"no upload {key.hex()} on this connection", code="no_such_upload")
        if upload.kind != kind:
            raise BadRequest(f"upload {key.hex()} is a {upload.kind}, not a {kind}")
        del self.records[key]
        if kind == MODEL:
            self.model_uploads.discard(upload.job)
        return upload

    def abort(self, holder: Hashable, key: bytes, reason: str) -> list[Effect]:
        upload = self.records.get(key)
        if upload is None or upload.holder != holder:
            raise NotFound(f"no upload {key.hex()} on this connection", code="no_such_upload")
        return self._drop(key, upload, reason)

    def dropped_by(self, holder: Hashable) -> list[Effect]:
        """``holder`` (a gateway connection) went away: every upload it was receiving goes."""
        effects: list[Effect] = []
        for key, upload in [(k, u) for k, u in self.records.items() if u.holder == holder]:
            effects += self._drop(key, upload, "connection_lost")
        return effects

    def _drop(self, key: bytes, upload: Upload, reason: str) -> list[Effect]:
        del self.records[key]
        if upload.kind == MODEL:
            self.model_uploads.discard(upload.job)
        effects: list[Effect] = [ReleaseUpload(key, upload)]
        if upload.kind == UPDATE:
            effects.append(GiveBackSlot(upload.job, upload.slot, upload.round, reason))
        return effects

    def update_done(self, key: bytes) -> str | None:
        """A client update admitted here is no longer in flight (aggregated, installed, or let
        go): its job, or None if ``key`` is no such update (a partial sum, another node's result)."""
        job = self.in_flight.pop(key, None)
        if job is not None:
            self.counts[job] -= 1
        return job


RECONCILE_PASSES = 10  # answered checks of a job (a second apart) after its last reservation of unknown outcome


class Slots:
    """The round slots this node holds in Redis, by job and token, from the reservation until
    the slot is accepted, refused or given back.

    A reservation whose answer was lost (Redis froze or restarted) may still run later: its
    command can sit in the server's socket buffer until the server resumes, after the node gave
    the slot back. Such a job is *unsure*: the node asks Redis which slots it holds there
    (``check``) until RECONCILE_PASSES answers came with nothing unknown, and gives back every
    slot it does not know of (``orphans``). Giving back a slot that was accepted meanwhile does
    nothing (by token), so a stale answer is safe."""

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}
        self._unsure: dict[str, int] = {}  # job -> answered checks still to make

    def taking(self, job: str, tokens: list[str]) -> None:
        self._held.setdefault(job, set()).update(tokens)

    def released(self, job: str, tokens: list[str]) -> None:
        """Accepted, refused or given back: Redis holds no slot of theirs any more."""
        held = self._held.get(job)
        if held is not None:
            held.difference_update(tokens)
            if not held:
                del self._held[job]

    def unknown(self, job: str, tokens: list[str]) -> None:
        """Their reservation's outcome is unknown: given back, and the job checked for late ones."""
        self.released(job, tokens)
        self._unsure[job] = RECONCILE_PASSES

    def check(self) -> list[str]:
        """Jobs whose slots in Redis the node must compare with its own."""
        return sorted(self._unsure)

    def orphans(self, job: str, in_redis: list[str]) -> list[str]:
        """Of the slots Redis says this node holds in ``job`` (one check answered), those it does not hold."""
        held = self._held.get(job, set())
        found = sorted(t for t in in_redis if t not in held)
        left = RECONCILE_PASSES if found else self._unsure.get(job, 1) - 1
        if left > 0:
            self._unsure[job] = left
        else:
            self._unsure.pop(job, None)
        return found
