"""Resumable uploads over HTTP (tus 1.0: core, ``creation``, ``expiration``, ``termination``):
the shell around the pure book of gateway/resumable.py, on the gateway's loop.

A resumable upload is an ordinary update's ``Ingest`` (gateway/service.py) kept between
requests, so it is checked, admitted and handed over exactly as an update's POST is: its
creation checks what the POST checks before the first byte (the token, the job, the X-Lifl-*
metadata, the base version, the size), and the bytes of its PATCHes go into the same sink, whose
header is validated and admitted by the agent (the round's slot, shared memory, quotas, the
in-flight budget) and whose tensors are checked for finiteness as they arrive. A PATCH's body is
read by the HTTP connection as an upload's (``HttpConnection._receive_blob``), through a
``PatchWriter``: the upload's sink, with what differs for a PATCH. When the last byte is in, the
update is handed over as a completed POST's is and answered the same.

Bytes received stay in the upload (the offset HEAD answers) until it is finished, cancelled,
refused (a malformed header, an admission refused, a non-finite tensor) or expires; the memory
the agent reserved for it stays reserved meanwhile, and its round slot held.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from typing import Any

from lifl.auth import Principal
from lifl.errors import BadRequest, LiflError, NotFound
from lifl.gateway.ingest import BlobSink
from lifl.gateway.resumable import Resumable, ResumableTable
from lifl.gateway.service import GatewayService, Ingest
from lifl.net import tus
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import Timer

SWEEP_S = 1.0  # s between two looks for expired uploads: one expires at most this long after its time
# How a PATCH ends when its connection fails rather than its bytes: closed mid-body (``truncated``)
# or too slow (``body_timeout``). The bytes it brought stay; the client resumes from them.
CUT_SHORT = frozenset({"truncated", "body_timeout"})


def owner_of(principal: Principal) -> Principal:
    """Who an upload belongs to: the principal, whichever of its tokens it presents."""
    return dataclasses.replace(principal, token="")


def _nothing() -> None:
    """A continuation with nothing to do."""


def _nothing_ready(error: LiflError | None) -> None:
    """A PatchWriter's ``on_ready`` until its connection sets one."""


class _Complete:
    """The sink of an upload whose bytes are all in and handed over: it takes none (a PATCH of
    it has no body, which begin_patch ensures), and it is ready at once."""

    ready = True

    @staticmethod
    def buffer() -> memoryview:
        return memoryview(b"")


COMPLETE = _Complete()


class ResumableUploads:
    """The gateway's resumable uploads (its HTTP front end's): creation, status, PATCHes,
    cancellation and expiry, within ``limits``' ``upload_idle``, ``max_uploads`` and
    ``max_uploads_per_principal``."""

    def __init__(self, service: GatewayService, limits: ConnectionLimits) -> None:
        self.service = service
        self.table = ResumableTable(limits.upload_idle, limits.max_uploads, limits.max_uploads_per_principal)
        self._sweeper: Timer | None = None

    def create(self, caller: Principal, job: str, headers: Mapping[str, str], fields: dict[str, Any],
               done: Callable[[Resumable | None, BaseException | None], None]) -> None:
        """A new upload of an update of ``job`` (POST): ``fields`` are the update's metadata as
        sent (X-Lifl-* headers), ``headers`` the request's. ``done(upload)`` once it is checked
        like an update's POST; it holds nothing in shared memory until its header has come."""
        tus.check_version(headers)
        if "upload-defer-length" in headers:
            raise BadRequest("Upload-Defer-Length is not supported (no creation-defer-length): send Upload-Length",
                             code="bad_header")
        length = tus.byte_count(headers, "Upload-Length")
        metadata = tus.check_metadata(headers.get("upload-metadata", ""))
        owner = owner_of(caller)
        self.table.check_room(owner, time.monotonic())

        def opened(ingest: Ingest | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert ingest is not None
            try:
                upload = self.table.create(secrets.token_hex(16), owner, job, length, metadata, ingest, time.monotonic())
            except LiflError as e:  # the last room went while the job was read
                refusal = e
                ingest.abort(refusal, then=lambda: done(None, refusal))
                return
            ingest.on_ready = lambda error: self._ready(upload, error)
            if self._sweeper is None:
                self._sweeper = self.service.loop.every("resumable upload expiry", SWEEP_S, self._sweep)
            done(upload, None)

        self.service.begin_update(caller, job, fields, "http", length, opened)

    def find(self, caller: Principal, job: str, upload_id: str) -> Resumable:
        """``caller``'s upload ``upload_id`` of ``job`` (NotFound otherwise, or if its object was
        lost with a restarted agent: it is dropped then, and the client starts a new one)."""
        upload = self.table.find(upload_id, owner_of(caller), job)
        if not upload.finished and upload.receiver.lost:
            error = NotFound(f"upload {upload_id} was lost: the node's agent restarted since its header came; create a "
                             "new one", code="no_such_upload")
            self.drop(upload, error)
            raise error
        return upload

    def status(self, caller: Principal, job: str, upload_id: str, headers: Mapping[str, str]) -> dict[str, str]:
        """What HEAD answers of the upload."""
        tus.check_version(headers)
        return self.headers(self.find(caller, job, upload_id), status=True)

    def offset(self, upload: Resumable) -> int:
        """The bytes the gateway holds of the upload (in its sink: in shared memory once admitted)."""
        return upload.length if upload.finished else upload.receiver.sink.received

    def headers(self, upload: Resumable, *, status: bool = False) -> dict[str, str]:
        """The tus headers of an answer about the upload: its offset and, while it is incomplete,
        when it expires; ``status`` (HEAD) adds its length and metadata, and forbids caching."""
        now = time.monotonic()
        headers = {"Upload-Offset": str(self.offset(upload))}
        if not upload.finished:
            headers["Upload-Expires"] = formatdate(time.time() + self.table.expires_at(upload, now) - now, usegmt=True)
        if status:
            headers.update({"Upload-Length": str(upload.length), "Cache-Control": "no-store"})
            if upload.metadata:
                headers["Upload-Metadata"] = upload.metadata
        return headers

    def open_patch(self, caller: Principal, job: str, upload_id: str, headers: Mapping[str, str],
                   length: int | None) -> PatchWriter:
        """A PATCH of ``length`` bytes (its Content-Length) may write the upload: what its body is read into."""
        tus.check_version(headers)
        tus.check_patch_type(headers)
        offset = tus.byte_count(headers, "Upload-Offset")
        if length is None:
            raise BadRequest("a PATCH needs Content-Length: its bytes are appended at Upload-Offset", code="length_required")
        upload = self.find(caller, job, upload_id)
        writer = PatchWriter(self, upload)
        self.table.begin_patch(upload, writer, offset, length, self.offset(upload))
        return writer

    def cancel(self, caller: Principal, job: str, upload_id: str, headers: Mapping[str, str],
               done: Callable[[None, BaseException | None], None]) -> None:
        """Terminate the upload (DELETE); ``done()`` once its object and round slot are given back."""
        tus.check_version(headers)
        upload = self.find(caller, job, upload_id)
        self.table.cancel(upload)
        if upload.finished:
            done(None, None)
        else:
            upload.receiver.abort(LiflError(f"upload {upload_id} was cancelled", code="upload_cancelled"),
                                  then=lambda: done(None, None))

    def _ready(self, upload: Resumable, error: LiflError | None) -> None:
        """The agent answered the admission of the upload's blob: its PATCH (if one is waiting)
        goes on or is refused; with none waiting, a refusal drops the upload at once."""
        writer = upload.writer
        if isinstance(writer, PatchWriter):
            writer.on_ready(error)
        elif error is not None:
            self.drop(upload, error)

    def drop(self, upload: Resumable, error: LiflError, then: Callable[[], None] = _nothing) -> None:
        """The upload is refused: out of the table, its object, slot and reservation given back."""
        self.table.remove(upload)
        upload.receiver.abort(error, then)

    def _sweep(self) -> None:
        for upload in self.table.expire(time.monotonic()):
            upload.receiver.abort(LiflError(f"upload {upload.id} expired after {self.table.idle_s:g} s without a PATCH",
                                            code="upload_expired"))


class PatchWriter:
    """One PATCH's hold on an upload. The HTTP connection reads the PATCH's body into it as it
    reads an ordinary upload's into its ``Ingest`` (``sink``, ``on_ready``, ``finish``, ``abort``);
    it differs where a PATCH does: its body may end before the blob does (the next PATCH goes
    on from there), a PATCH whose connection failed or stalled keeps the bytes it brought, and
    only a refusal of the blob itself (its header, its admission, a non-finite tensor) drops
    the upload. A PATCH of no bytes at the end of a finished upload answers what completed it."""

    def __init__(self, uploads: ResumableUploads, upload: Resumable) -> None:
        self.uploads, self.upload = uploads, upload
        self.on_ready: Callable[[LiflError | None], None] = _nothing_ready
        self._finishing = False  # the blob is with the agent: the outcome is the upload's, whatever the connection does

    @property
    def sink(self) -> BlobSink | _Complete:
        return COMPLETE if self.upload.finished else self.upload.receiver.sink

    def finish(self, done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        """The PATCH's body ended: ``done(None, None)`` if the blob is not complete yet, else the
        update's answer once the agent has taken it (or the error it was refused with)."""
        upload, table = self.upload, self.uploads.table
        if upload.finished:
            table.end_patch(upload, self, time.monotonic())
            done(*upload.outcome)
        elif not upload.receiver.sink.done:
            table.end_patch(upload, self, time.monotonic())
            done(None, None)
        else:
            self._finishing = True
            try:
                upload.receiver.finish(lambda result, error: self._finished(result, error, done))
            except LiflError:
                self._finishing = False  # nothing was handed over: the connection's refusal drops the upload
                raise

    def _finished(self, result: dict[str, Any] | None, error: BaseException | None,
                  done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        self.uploads.table.finish(self.upload, (result, error), time.monotonic())
        done(result, error)

    def abort(self, error: LiflError | None, then: Callable[[], None] = _nothing) -> None:
        """The PATCH ends without its answer: its connection closed (``error`` None), was cut
        short or stalled (CUT_SHORT: the upload keeps its bytes), or the blob was refused (the
        upload is dropped); ``then()`` once that is done."""
        if self._finishing:
            then()
        elif self.upload.finished or error is None or error.code in CUT_SHORT:
            self.uploads.table.end_patch(self.upload, self, time.monotonic())
            then()
        else:
            self.uploads.drop(self.upload, error, then)
