"""Resumable uploads as a pure book: which uploads a gateway holds between their requests, who
owns each, who may write it now, when it expires, and what a finished one answered.

A resumable upload (tus 1.0, docs/api.md "Resumable uploads") outlives the connections that
carry its bytes: one PATCH at a time appends at the upload's offset (the bytes its receiver
holds), a PATCH cut short keeps what it brought, and an upload left without a PATCH for
``idle_s`` expires. Once its last byte is in and the update handed over, the upload is
*finished*: it holds no memory any more, and its outcome (the answer of the PATCH that
completed it) is kept for ``idle_s`` so that a client whose answer was lost learns it again.

Nothing here does I/O or reads a clock: the shell (gateway/tus.py) passes ``now`` and the
receiver's offset, keeps the receiver (the ``Ingest`` the bytes go into) in ``receiver``, and
does what a decision implies (aborting an expired upload's object, answering a PATCH).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from lifl.errors import Conflict, NotFound, Overloaded, PayloadTooLarge, QuotaBusy


@dataclass(eq=False)
class Resumable:
    id: str
    owner: Hashable  # the principal that created it: nobody else finds it
    job: str
    length: int  # Upload-Length: the whole blob
    metadata: str  # Upload-Metadata as sent, answered back on HEAD
    receiver: Any  # the shell's, receiving the bytes; None once finished
    last_active: float  # when it was created, or its last PATCH ended
    writer: Hashable | None = None  # the PATCH writing it now (one at a time)
    finished: bool = False
    outcome: Any = None  # once finished: what the PATCH that completed it answered


class ResumableTable:
    """A gateway's resumable uploads by id: at most ``max_uploads`` incomplete ones, at most
    ``max_per_owner`` of one principal; each expires ``idle_s`` after its creation or its last
    PATCH unless a PATCH is writing it."""

    def __init__(self, idle_s: float, max_uploads: int, max_per_owner: int) -> None:
        self.idle_s = idle_s
        self.max_uploads = max_uploads
        self.max_per_owner = max_per_owner
        self._uploads: dict[str, Resumable] = {}
        self._incomplete: Counter[Hashable] = Counter()  # by owner
        self._incomplete_total = 0

    def __len__(self) -> int:
        return len(self._uploads)

    @property
    def incomplete(self) -> int:
        return self._incomplete_total

    def check_room(self, owner: Hashable, now: float) -> None:
        """Refuse a new upload of ``owner`` past a limit: 503 past the gateway's (``too_many_uploads``,
        --max-uploads), 429 past the principal's (--max-uploads-per-principal); Retry-After is
        when the first idle upload of that scope expires."""
        if self._incomplete_total >= self.max_uploads:
            wait = self._first_expiry(self._uploads.values(), now)
            raise Overloaded(f"this gateway holds {self._incomplete_total} incomplete resumable uploads, its limit "
                             f"(--max-uploads); retry in {wait:g} s", code="too_many_uploads", retry_after=wait)
        have = self._incomplete[owner]
        if have >= self.max_per_owner:
            wait = self._first_expiry((u for u in self._uploads.values() if u.owner == owner), now)
            raise QuotaBusy(f"the caller holds {have} incomplete resumable uploads on this gateway, its limit "
                            f"(--max-uploads-per-principal): finish or DELETE one, or retry in {wait:g} s when the "
                            "first idle one expires", code="too_many_uploads", retry_after=wait)

    def _first_expiry(self, uploads: Iterable[Resumable], now: float) -> float:
        """Whole seconds (at least 1) until the first of ``uploads`` that is incomplete and idle expires."""
        ends = [u.last_active + self.idle_s for u in uploads if not u.finished and u.writer is None]
        return float(max(1, math.ceil(min(ends) - now))) if ends else 1.0

    def create(self, upload_id: str, owner: Hashable, job: str, length: int, metadata: str, receiver: Any,
               now: float) -> Resumable:
        """A new incomplete upload (``check_room`` first); ``upload_id`` must be new (and unguessable)."""
        self.check_room(owner, now)
        assert upload_id not in self._uploads, "upload ids are random: a repeat is a bug"
        upload = Resumable(upload_id, owner, job, length, metadata, receiver, now)
        self._uploads[upload_id] = upload
        self._incomplete[owner] += 1
        self._incomplete_total += 1
        return upload

    def find(self, upload_id: str, owner: Hashable, job: str) -> Resumable:
        """The upload ``upload_id`` of job ``job`` if ``owner`` made it; NotFound otherwise, with
        one message whatever the reason, so that ids of others' uploads cannot be told apart."""
        upload = self._uploads.get(upload_id)
        if upload is None or upload.owner != owner or upload.job != job:
            raise NotFound(f"no upload {upload_id[:64]!r} of job {job!r}: it never existed, is another caller's, was "
                           f"cancelled, was refused, or expired after {self.idle_s:g} s without a PATCH",
                           code="no_such_upload")
        return upload

    def begin_patch(self, upload: Resumable, writer: Hashable, offset: int, count: int, have: int) -> None:
        """``writer`` (a PATCH of ``count`` bytes at Upload-Offset ``offset``) may write ``upload``,
        which holds ``have`` bytes: Conflict if another PATCH writes it (``upload_busy``) or the
        offsets differ (``offset_mismatch``, its ``offset`` in the body), PayloadTooLarge if the
        bytes would pass its length. Nothing changes unless it may."""
        if upload.writer is not None:
            raise Conflict(f"upload {upload.id} is being written by another PATCH; ask HEAD for its offset once that "
                           "one ends, and send the rest from there", code="upload_busy")
        if offset != have:
            raise Conflict(f"Upload-Offset {offset} does not match the offset of upload {upload.id}, {have}: ask HEAD "
                           "for it and send the bytes from there", code="offset_mismatch", extra={"offset": have})
        if count > upload.length - have:
            raise PayloadTooLarge(f"a PATCH of {count} bytes at offset {have} passes the end of upload {upload.id}, "
                                  f"{upload.length} bytes long", code="beyond_upload_length")
        upload.writer = writer

    def end_patch(self, upload: Resumable, writer: Hashable, now: float) -> None:
        """``writer``'s PATCH ended (answered, cut short or stalled); the upload's idle time starts."""
        if upload.writer is writer:
            upload.writer = None
            upload.last_active = now

    def finish(self, upload: Resumable, outcome: Any, now: float) -> None:
        """Its last byte is in and the blob was handed over (``outcome``: what that answered). It
        holds no memory any more and counts against no limit; its outcome is kept ``idle_s``."""
        self._forget_incomplete(upload)
        upload.finished, upload.outcome, upload.receiver = True, outcome, None
        upload.writer, upload.last_active = None, now

    def cancel(self, upload: Resumable) -> None:
        """Take the upload out (DELETE), unless a PATCH is writing it (``upload_busy``)."""
        if upload.writer is not None:
            raise Conflict(f"upload {upload.id} is being written by a PATCH: cancel it once that one ends",
                           code="upload_busy")
        self.remove(upload)

    def remove(self, upload: Resumable) -> None:
        """Take the upload out (refused, cancelled, or its receiver lost)."""
        if self._uploads.pop(upload.id, None) is upload:
            self._forget_incomplete(upload)

    def _forget_incomplete(self, upload: Resumable) -> None:
        if not upload.finished:
            self._incomplete[upload.owner] -= 1
            if not self._incomplete[upload.owner]:
                del self._incomplete[upload.owner]
            self._incomplete_total -= 1

    def expire(self, now: float) -> list[Resumable]:
        """Take out the uploads idle for ``idle_s`` (no PATCH writing them): the incomplete ones
        are returned (their receivers must be let go), finished ones are forgotten."""
        expired = [u for u in self._uploads.values() if u.writer is None and now - u.last_active >= self.idle_s]
        for upload in expired:
            self.remove(upload)
        return [u for u in expired if not u.finished]

    def expires_at(self, upload: Resumable, now: float) -> float:
        """When the upload expires if no PATCH comes (one writing it now restarts the count when it ends)."""
        return (now if upload.writer is not None else upload.last_active) + self.idle_s
