"""Resumable uploads (tus 1.0): the headers (lifl.net.tus) and the upload table
(gateway/resumable.py) with tables, then the protocol against a real node (cuts at every stage,
offsets, expiry, races, limits, malformed requests, validation as bytes arrive) and the SDK's
push from a file that resumes by itself."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, read_response, wait_for
from lifl import format as fmt
from lifl.bench.cutting import DOWN, UP, CuttingProxy
from lifl.client import Gateway, RetryPolicy, from_blob
from lifl.errors import BadRequest, Conflict, NotFound, Overloaded, PayloadTooLarge, PreconditionFailed, QuotaBusy
from lifl.errors import UnsupportedMediaType, Unprocessable
from lifl.gateway.resumable import ResumableTable
from lifl.net import tus
from lifl.net.limits import ConnectionLimits

# -- headers ---------------------------------------------------------------------------------------


def upload_length(headers: dict[str, str]) -> int:
    return tus.byte_count(headers, "Upload-Length")


def metadata(headers: dict[str, str]) -> str:
    return tus.check_metadata(headers.get("upload-metadata", ""))


VERSION, LENGTH, TYPE, METADATA = ((tus.check_version, "tus-resumable"), (upload_length, "upload-length"),
                                   (tus.check_patch_type, "content-type"), (metadata, "upload-metadata"))
HEADERS = [  # which check, the value sent (None: no such header) -> the error (None: taken), its code
    (VERSION, "1.0.0", None, None),
    (VERSION, None, PreconditionFailed, "unsupported_version"),
    (VERSION, "", PreconditionFailed, "unsupported_version"),
    (VERSION, "0.2.2", PreconditionFailed, "unsupported_version"),
    (VERSION, "1.0", PreconditionFailed, "unsupported_version"),
    (VERSION, "1.0.0, 0.2.2", PreconditionFailed, "unsupported_version"),
    (LENGTH, "0", None, None),
    (LENGTH, "123", None, None),
    (LENGTH, "9" * 18, None, None),
    *[(LENGTH, sent, BadRequest, "bad_header")
      for sent in (None, "", "-5", "+5", "abc", "1e3", "1.0", "1 2", "\u0663", "9" * 19, "0x10")],
    (TYPE, "application/offset+octet-stream", None, None),
    (TYPE, "APPLICATION/Offset+Octet-Stream", None, None),
    (TYPE, "application/offset+octet-stream; charset=binary", None, None),
    *[(TYPE, sent, UnsupportedMediaType, "bad_content_type") for sent in (None, "", "application/octet-stream", "text/plain")],
    *[(METADATA, sent, None, None) for sent in (None, "name", "name ZmlsZQ==", "a YQ==,b,c YWJj")],
    *[(METADATA, sent, BadRequest, "bad_header") for sent in ("a b c", "a !!!!", "a YQ", ",", "a,a", "a YQ==,a YQ==", "ä YQ==")],
]


@pytest.mark.parametrize(("check", "sent", "error", "code"), HEADERS)
def test_tus_headers_are_read_strictly(check: tuple[Any, str], sent: str | None, error: type | None, code: str | None) -> None:
    read, name = check
    headers = {} if sent is None else {name: sent}
    if error is None:
        assert read(headers) == (int(sent) if name == "upload-length" else sent or "" if name == "upload-metadata" else None)
        return
    with pytest.raises(error) as info:
        read(headers)
    assert info.value.code == code
    assert {"tus-resumable": "Tus-Resumable: 1.0.0", "upload-length": "Upload-Length", "content-type": tus.OFFSET_STREAM,
            "upload-metadata": "Upload-Metadata"}[name] in info.value.message


# -- the table --------------------------------------------------------------------------------------
IDLE = 10.0


def table(max_uploads: int = 4, per_owner: int = 2) -> ResumableTable:
    return ResumableTable(IDLE, max_uploads, per_owner)


PATCHES = [  # busy, Upload-Offset, bytes, held, length -> error code (None: it may write)
    (False, 0, 100, 0, 100, None),
    (False, 40, 60, 40, 100, None),
    (False, 40, 10, 40, 100, None),  # a part of the rest
    (False, 100, 0, 100, 100, None),  # nothing at the end: a finished upload's answer, again
    (False, 0, 10, 40, 100, "offset_mismatch"),
    (False, 50, 10, 40, 100, "offset_mismatch"),
    (False, 40, 61, 40, 100, "beyond_upload_length"),
    (True, 40, 10, 40, 100, "upload_busy"),  # another PATCH writes it: said first, whatever the offset
    (True, 0, 10, 40, 100, "upload_busy"),
]


@pytest.mark.parametrize(("busy", "offset", "count", "have", "length", "code"), PATCHES)
def test_begin_patch(busy: bool, offset: int, count: int, have: int, length: int, code: str | None) -> None:
    t = table()
    upload = t.create("u1", "alice", "j", length, "", None, now=0.0)
    if busy:
        t.begin_patch(upload, "other", have, 0, have)
    if code is None:
        t.begin_patch(upload, "me", offset, count, have)
        assert upload.writer == "me"
        return
    with pytest.raises((Conflict, PayloadTooLarge)) as info:
        t.begin_patch(upload, "me", offset, count, have)
    assert info.value.code == code and upload.writer == ("other" if busy else None)
    if code == "offset_mismatch":
        assert f"Upload-Offset {offset} " in info.value.message and f", {have}:" in info.value.message
        assert info.value.extra == {"offset": have}


def test_uploads_are_found_by_their_owner_in_their_job_only() -> None:
    t = table()
    upload = t.create("u1", "alice", "j", 10, "", None, now=0.0)
    assert t.find("u1", "alice", "j") is upload
    messages = set()
    for upload_id, owner, job in [("u1", "bob", "j"), ("u1", "alice", "k"), ("u2", "alice", "j")]:
        with pytest.raises(NotFound) as info:
            t.find(upload_id, owner, job)
        assert info.value.code == "no_such_upload"
        messages.add(info.value.message.replace(upload_id, "ID").replace(f"'{job}'", "JOB"))
    assert len(messages) == 1, "one message whatever the reason: ids of others' uploads cannot be told apart"


def test_limits_per_principal_and_per_gateway_at_and_past() -> None:
    t = table(max_uploads=3, per_owner=2)
    t.create("a1", "alice", "j", 10, "", None, now=0.0)
    t.create("a2", "alice", "j", 10, "", None, now=4.0)  # alice at her limit
    with pytest.raises(QuotaBusy) as info:
        t.check_room("alice", now=5.0)
    assert (info.value.status, info.value.code, info.value.retry_after) == (429, "too_many_uploads", 5.0)  # a1 expires at 10
    assert "--max-uploads-per-principal" in info.value.message
    t.create("b1", "bob", "j", 10, "", None, now=5.0)  # the gateway at its limit
    with pytest.raises(Overloaded) as info:
        t.check_room("carol", now=5.0)
    assert (info.value.status, info.value.code, info.value.retry_after) == (503, "too_many_uploads", 5.0)
    assert "--max-uploads" in info.value.message
    t.begin_patch(t.find("a1", "alice", "j"), "w", 0, 10, 0)  # being written: it does not expire
    with pytest.raises(Overloaded) as info:
        t.check_room("carol", now=5.0)
    assert info.value.retry_after == 9.0  # a2 expires at 14
    t.finish(t.find("a1", "alice", "j"), ({"version": 0}, None), now=6.0)  # finished: it counts no more
    assert t.incomplete == 2 and len(t) == 3
    t.check_room("alice", now=6.0)
    t.check_room("carol", now=6.0)
    t.cancel(t.find("a2", "alice", "j"))
    assert t.incomplete == 1


def test_expiry_takes_idle_uploads_and_forgets_finished_ones() -> None:
    t = table(max_uploads=10, per_owner=10)
    idle = t.create("idle", "o", "j", 10, "", None, now=0.0)
    writing = t.create("writing", "o", "j", 10, "", None, now=0.0)
    t.begin_patch(writing, "w", 0, 10, 0)
    done = t.create("done", "o", "j", 10, "", None, now=0.0)
    t.finish(done, ({"version": 0}, None), now=5.0)
    t.create("recent", "o", "j", 10, "", None, now=6.0)
    assert t.expires_at(idle, now=1.0) == IDLE and t.expires_at(writing, now=3.0) == 3.0 + IDLE
    assert t.expire(now=IDLE - 0.1) == []
    assert t.expire(now=IDLE) == [idle]  # the finished one is kept until IDLE after it finished
    t.end_patch(writing, "w", now=IDLE + 1)  # its idle time starts when its PATCH ends
    assert t.expire(now=IDLE + 5) == [] and len(t) == 2  # "done" is forgotten, and returned to nobody
    assert sorted(u.id for u in t.expire(now=2 * IDLE + 1)) == ["recent", "writing"]
    assert len(t) == 0 and t.incomplete == 0


def test_a_patch_ends_only_its_own_hold() -> None:
    t = table()
    upload = t.create("u1", "o", "j", 10, "", None, now=0.0)
    t.begin_patch(upload, "first", 0, 5, 0)
    t.end_patch(upload, "second", now=1.0)  # a PATCH that never held it
    assert upload.writer == "first" and upload.last_active == 0.0
    with pytest.raises(Conflict) as info:
        t.cancel(upload)
    assert info.value.code == "upload_busy"
    t.end_patch(upload, "first", now=2.0)
    assert upload.writer is None and upload.last_active == 2.0


# -- on a real node ---------------------------------------------------------------------------------
MODEL = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(64, np.float32)}
UPDATE = fmt.encode({"w": np.full((64, 64), 2.0, np.float32), "b": np.ones(64, np.float32)})
HEADER_END = fmt.PREFIX_BYTES + int.from_bytes(UPDATE[:8], "little")
TUS = {"Tus-Resumable": tus.VERSION}
PATCH = {**TUS, "Content-Type": tus.OFFSET_STREAM}
MAX_UPDATE = 1 << 20


def make_job(node: RunningNode, job: str = "j", goal: int = 2) -> str:
    assert node.json("POST", "/v1/jobs", {"job": job, "goal": goal, "max_update_bytes": MAX_UPDATE})[0] == 201
    assert node.json("PUT", f"/v1/jobs/{job}/model", fmt.encode(MODEL))[0] == 201
    return job


def client_token(node: RunningNode, client: str, job: str = "j") -> str:
    status, body = node.json("POST", "/v1/tokens", {"role": "client", "tenant": "default", "job": job, "client": client})
    assert status == 201, body
    return body["token"]


def create(node: RunningNode, job: str = "j", length: int = len(UPDATE), client: str = "c1", token: str = OPERATOR_TOKEN,
           **headers: str | None) -> tuple[int, dict[str, str], Any]:
    h: dict[str, str | None] = {**TUS, "Upload-Length": str(length), "X-Lifl-Client": client, "X-Lifl-Samples": "3",
                                "X-Lifl-Base-Version": "0", "Authorization": f"Bearer {token}", **headers}
    status, answer, body = node.request("POST", f"/v1/jobs/{job}/uploads", b"", h)
    return status, answer, json.loads(body) if body else None


def new_upload(node: RunningNode, **options: Any) -> str:
    status, headers, body = create(node, **options)
    assert status == 201, body
    return headers["Location"]


def head(node: RunningNode, location: str, token: str = OPERATOR_TOKEN) -> tuple[int, dict[str, str]]:
    status, headers, body = node.request("HEAD", location, None, {**TUS, "Authorization": f"Bearer {token}"})
    assert body == b""
    return status, headers


def offset(node: RunningNode, location: str, token: str = OPERATOR_TOKEN) -> int:
    status, headers = head(node, location, token)
    assert status == 200, status
    return int(headers["Upload-Offset"])


def patch(node: RunningNode, location: str, at: int, data: bytes, token: str = OPERATOR_TOKEN,
          **headers: str | None) -> tuple[int, dict[str, str], Any]:
    h = {**PATCH, "Upload-Offset": str(at), "Authorization": f"Bearer {token}", **headers}
    status, answer, body = node.request("PATCH", location, data, h)
    return status, answer, json.loads(body) if body else None


def resume(node: RunningNode, location: str, at: int, data: bytes) -> tuple[int, dict[str, str], Any]:
    """``patch``, sent again while the gateway has not yet seen the end of the client's last PATCH
    (409 upload_busy), as a client resuming after a cut does."""

    def free() -> tuple[int, dict[str, str], Any] | None:
        answer = patch(node, location, at, data)
        return None if answer[0] == 409 and answer[2]["error"]["code"] == "upload_busy" else answer

    return wait_for(free, what="the last PATCH to end")


def cut_patch(node: RunningNode, location: str, at: int, data: bytes, length: int) -> None:
    """A PATCH announcing ``length`` bytes whose connection ends after ``data``, its answer unread."""
    host, port = node.http.rsplit(":", 1)
    head_lines = (f"PATCH {location} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\n"
                  f"Tus-Resumable: {tus.VERSION}\r\nContent-Type: {tus.OFFSET_STREAM}\r\nUpload-Offset: {at}\r\n"
                  f"Content-Length: {length}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head_lines.encode() + data)


def round_status(node: RunningNode, job: str = "j") -> dict[str, Any]:
    status, body = node.json("GET", f"/v1/jobs/{job}")
    assert status == 200
    return body["round"]


def reserved_bytes(node: RunningNode, job: str = "j") -> float:
    """Shared memory the node holds for the job's round: its objects and what it reserved."""
    text = node.request("GET", "/metrics")[2].decode()
    prefix = f'lifl_job_shm_bytes{{job="{job}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.slow
def test_a_resumable_upload_is_admitted_and_answered_as_an_update(node: RunningNode) -> None:
    make_job(node, goal=2)
    status, headers, body = create(node)
    location = headers["Location"]
    assert status == 201 and body == {"upload": location.rsplit("/", 1)[1], "location": location}
    assert len(body["upload"]) == 32 and headers["Tus-Resumable"] == tus.VERSION and "Upload-Expires" in headers
    status, headers, _ = node.request("OPTIONS", "/v1/jobs/j/uploads")
    assert (status, headers["Tus-Version"], headers["Tus-Extension"], headers["Tus-Max-Size"]) == (
        204, "1.0.0", "creation,expiration,termination", str(MAX_UPDATE))
    status, headers = head(node, location)
    assert (status, headers["Upload-Offset"], headers["Upload-Length"], headers["Cache-Control"]) == (
        200, "0", str(len(UPDATE)), "no-store")
    assert round_status(node)["in_progress"] == 0  # nothing admitted before the blob's header
    pieces = [0, HEADER_END // 2, HEADER_END + 1000, len(UPDATE)]  # mid-header, header and some data, the rest
    for start, end in zip(pieces[:-2], pieces[1:-1]):
        status, headers, _ = patch(node, location, start, UPDATE[start:end])
        assert (status, headers["Upload-Offset"]) == (204, str(end)) and "Upload-Expires" in headers
    assert round_status(node)["in_progress"] == 1 and reserved_bytes(node) >= len(UPDATE)  # admitted: slot and memory
    status, headers, body = patch(node, location, pieces[-2], UPDATE[pieces[-2]:])
    assert (status, body, headers["Upload-Offset"]) == (202, {"version": 0}, str(len(UPDATE)))
    assert node.push("j", UPDATE, client="c2", samples=1)[1] == {"version": 0}  # what an ordinary upload answers
    status, headers = head(node, location)  # finished: its offset is its length, and it no longer expires
    assert (status, headers["Upload-Offset"]) == (200, str(len(UPDATE))) and "Upload-Expires" not in headers
    assert patch(node, location, len(UPDATE), b"")[::2] == (202, {"version": 0})  # the answer, again
    wait_for(lambda: node.json("GET", "/v1/jobs/j")[1]["version"] == 1, what="the round with both updates")
    model = from_blob(node.request("GET", "/v1/jobs/j/model")[2])
    np.testing.assert_array_equal(model["w"], np.full((64, 64), 2.0, np.float32))


STAGES = {  # bytes a first PATCH brings before its connection ends (None: no PATCH at all)
    "after creation": None,
    "mid-header": HEADER_END // 2,
    "after the header": HEADER_END,
    "mid-data": (HEADER_END + len(UPDATE)) // 2,
    "right before the last byte": len(UPDATE) - 1,
    "after the last byte": len(UPDATE),  # the answer is lost: asked for again with a PATCH of no bytes
}


@pytest.mark.slow
def test_a_cut_at_every_stage_keeps_the_bytes_and_the_reservation(node: RunningNode) -> None:
    make_job(node, goal=len(STAGES) + 1)
    for number, (stage, cut) in enumerate(STAGES.items()):
        location = new_upload(node, client=f"c{number}")
        if cut is not None:
            cut_patch(node, location, 0, UPDATE[:cut], len(UPDATE))
        wait_for(lambda: offset(node, location) == (cut or 0), what=f"the bytes before the cut {stage}")
        if cut is not None and HEADER_END <= cut < len(UPDATE):  # admitted: the slot and the memory stay
            wait_for(lambda: round_status(node)["in_progress"] == 1, what=f"the admission of the header {stage}")
            assert reserved_bytes(node) >= len(UPDATE), stage
        status, headers, body = resume(node, location, cut or 0, UPDATE[cut or 0:])
        assert (status, body) == (202, {"version": 0}), (stage, body)
        assert round_status(node)["in_progress"] == 0
    assert round_status(node)["received"] == len(STAGES)


@pytest.mark.slow
def test_a_wrong_offset_is_a_conflict_naming_both_offsets(node: RunningNode) -> None:
    make_job(node)
    location = new_upload(node)
    assert patch(node, location, 0, UPDATE[:50])[0] == 204
    for wrong in (0, 49, 51, len(UPDATE)):
        status, _, body = patch(node, location, wrong, UPDATE[wrong:wrong + 10])
        assert (status, body["error"]["code"], body["error"]["offset"]) == (409, "offset_mismatch", 50), wrong
        assert f"Upload-Offset {wrong} " in body["error"]["message"] and ", 50:" in body["error"]["message"]
        assert offset(node, location) == 50  # nothing written
    assert patch(node, location, 50, UPDATE[50:])[::2] == (202, {"version": 0})


@pytest.mark.slow
def test_an_idle_upload_expires_and_gives_everything_back(node_with: Any) -> None:
    node = node_with(gateway_limits=ConnectionLimits(upload_idle=3.0))  # the seconds between two requests, at most
    make_job(node)
    baseline = reserved_bytes(node)
    location = new_upload(node)
    status, headers, _ = patch(node, location, 0, UPDATE[: HEADER_END + 100])
    assert status == 204 and "Upload-Expires" in headers
    assert round_status(node)["in_progress"] == 1 and reserved_bytes(node) > baseline
    wait_for(lambda: head(node, location)[0] == 404, what="the idle upload to expire")
    wait_for(lambda: round_status(node)["in_progress"] == 0 and reserved_bytes(node) == baseline,
             what="its round slot and memory to be given back")
    assert round_status(node)["rejected"] == {"upload_expired": 1}
    status, _, body = patch(node, location, HEADER_END + 100, UPDATE[HEADER_END + 100:])
    assert (status, body["error"]["code"]) == (404, "no_such_upload") and "expired" in body["error"]["message"]
    assert node.push("j", UPDATE, client="c1")[1] == {"version": 0}  # the client's place in the round is free again


@pytest.mark.slow
def test_two_clients_racing_on_one_upload_one_writes_and_nothing_is_corrupted(node_with: Any) -> None:
    node = node_with(gateway_limits=ConnectionLimits(min_body_rate=0))  # the first PATCH may wait as long as it takes
    make_job(node, goal=1)
    location = new_upload(node)
    host, port = node.http.rsplit(":", 1)
    first = socket.create_connection((host, int(port)), timeout=30)
    half = HEADER_END + 4000
    first.sendall((f"PATCH {location} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\n"
                   f"Tus-Resumable: {tus.VERSION}\r\nContent-Type: {tus.OFFSET_STREAM}\r\nUpload-Offset: 0\r\n"
                   f"Content-Length: {len(UPDATE)}\r\n\r\n").encode() + UPDATE[:half])
    wait_for(lambda: offset(node, location) == half, what="the first PATCH to hold the upload")
    garbage = bytes(len(UPDATE) - half)  # the same length, other bytes: would corrupt the blob if written
    for at in (half, 0):
        status, _, body = patch(node, location, at, garbage[: len(UPDATE) - at])
        assert (status, body["error"]["code"]) == (409, "upload_busy"), at
    status, _, body = node.request("DELETE", location, None, TUS)
    assert (status, json.loads(body)["error"]["code"]) == (409, "upload_busy")
    assert offset(node, location) == half
    first.sendall(UPDATE[half:])
    status, _, body = read_response(first)
    first.close()
    assert (status, json.loads(body)) == (202, {"version": 0})
    wait_for(lambda: node.json("GET", "/v1/jobs/j")[1]["version"] == 1, what="the round")
    model = from_blob(node.request("GET", "/v1/jobs/j/model")[2])
    np.testing.assert_array_equal(model["w"], np.full((64, 64), 2.0, np.float32))


@pytest.mark.slow
def test_limits_on_incomplete_uploads_at_and_past(node_with: Any) -> None:
    node = node_with(gateway_limits=ConnectionLimits(max_uploads=3, max_uploads_per_principal=2))
    make_job(node, goal=5)
    alice, bob = client_token(node, "alice"), client_token(node, "bob")
    mine = [new_upload(node, client="alice", token=alice) for _ in range(2)]  # at alice's limit
    status, headers, body = create(node, client="alice", token=alice)
    assert (status, body["error"]["code"], int(headers["Retry-After"]) >= 1) == (429, "too_many_uploads", True)
    assert "--max-uploads-per-principal" in body["error"]["message"]
    assert node.request("DELETE", mine.pop(), None, {**TUS, "Authorization": f"Bearer {alice}"})[0] == 204
    mine.append(new_upload(node, client="alice", token=alice))
    new_upload(node, client="bob", token=bob)  # the gateway at its limit
    status, headers, body = create(node, client="bob", token=bob)
    assert (status, body["error"]["code"], int(headers["Retry-After"]) >= 1) == (503, "too_many_uploads", True)
    assert "--max-uploads" in body["error"]["message"]
    assert node.push("j", UPDATE, client="carol")[0] == 202  # ordinary uploads are not held to them
    assert patch(node, mine[0], 0, UPDATE, token=alice)[::2] == (202, {"version": 0})  # finished: room again
    new_upload(node, client="bob", token=bob)


@pytest.mark.slow
def test_malformed_requests_get_precise_errors_and_change_nothing(node: RunningNode) -> None:
    make_job(node)
    alice, bob = client_token(node, "alice"), client_token(node, "bob")
    creations = [  # extra or changed headers -> status, code
        ({"Tus-Resumable": None}, 412, "unsupported_version"),
        ({"Tus-Resumable": "0.2.2"}, 412, "unsupported_version"),
        ({"Upload-Length": None}, 400, "bad_header"),
        ({"Upload-Length": "-5"}, 400, "bad_header"),
        ({"Upload-Length": "abc"}, 400, "bad_header"),
        ({"Upload-Length": "1e3"}, 400, "bad_header"),
        ({"Upload-Length": str(MAX_UPDATE + 1)}, 413, "payload_too_large"),  # over the job's max_update_bytes
        ({"Upload-Length": "3"}, 400, "truncated"),  # shorter than a blob's header length
        ({"Upload-Defer-Length": "1"}, 400, "bad_header"),
        ({"Upload-Metadata": "a b c"}, 400, "bad_header"),
        ({"X-Lifl-Samples": None}, 400, "bad_header"),  # the update's own headers, checked as a POST's
        ({"X-Lifl-Samples": "-1"}, 400, "bad_header"),
        ({"X-Lifl-Client": "bob", "Authorization": f"Bearer {alice}"}, 403, "client_mismatch"),
        ({"Authorization": "Bearer nope"}, 401, "unauthenticated"),
    ]
    for changed, want, code in creations:
        status, headers, body = create(node, **changed)
        assert (status, (body or {}).get("error", {}).get("code")) == (want, code), (changed, status, body)
        assert headers["Tus-Resumable"] == tus.VERSION and (want != 412 or headers["Tus-Version"] == tus.VERSION)
    status, _, body = node.request("POST", "/v1/jobs/nope/uploads", b"", {**TUS, "Upload-Length": "100"})
    assert (status, json.loads(body)["error"]["code"]) == (404, "no_such_job")
    status, _, body = node.request("POST", "/v1/jobs/j/uploads", UPDATE, {
        **TUS, "Upload-Length": str(len(UPDATE)), "X-Lifl-Client": "c1", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"})
    assert (status, json.loads(body)["error"]["code"]) == (400, "unexpected_body")  # no creation-with-upload

    location = new_upload(node, client="alice", token=alice)
    assert patch(node, location, 0, UPDATE[:20], token=alice)[0] == 204
    patches = [  # headers -> status, code
        ({"Tus-Resumable": None}, 412, "unsupported_version"),
        ({"Tus-Resumable": "2.0.0"}, 412, "unsupported_version"),
        ({"Content-Type": "application/octet-stream"}, 415, "bad_content_type"),
        ({"Content-Type": None}, 415, "bad_content_type"),
        ({"Upload-Offset": None}, 400, "bad_header"),
        ({"Upload-Offset": "-20"}, 400, "bad_header"),
        ({"Upload-Offset": "twenty"}, 400, "bad_header"),
        ({"Authorization": f"Bearer {bob}"}, 404, "no_such_upload"),  # another principal's: as if it did not exist
    ]
    for changed, want, code in patches:
        status, headers, body = patch(node, location, 20, UPDATE[20:30], token=alice, **changed)
        assert (status, body["error"]["code"]) == (want, code), (changed, body)
        assert headers["Tus-Resumable"] == tus.VERSION
    status, _, body = patch(node, location, 20, UPDATE[20:] + b"extra", token=alice)
    assert (status, body["error"]["code"]) == (413, "beyond_upload_length")
    status, _, body = node.request("PATCH", location, iter([UPDATE[20:30]]), {
        **PATCH, "Upload-Offset": "20", "Authorization": f"Bearer {alice}", "Transfer-Encoding": "chunked"})
    assert (status, json.loads(body)["error"]["code"]) == (400, "length_required")
    status, _, body = patch(node, location.rsplit("/", 1)[0] + "/" + "0" * 32, 0, UPDATE[:10], token=alice)
    assert (status, body["error"]["code"]) == (404, "no_such_upload")
    assert head(node, location, token=bob)[0] == 404
    status, headers = head(node, location + "0", token=alice)
    assert status == 404 and "Upload-Offset" not in headers
    status, headers, _ = node.request("HEAD", location, None, {"Authorization": f"Bearer {alice}"})
    assert status == 412 and headers["Tus-Version"] == tus.VERSION
    assert offset(node, location, alice) == 20  # none of it wrote anything
    assert node.request("DELETE", location, None, {**TUS, "Authorization": f"Bearer {bob}"})[0] == 404
    assert node.request("DELETE", location, None, {**TUS, "Authorization": f"Bearer {alice}"})[0] == 204
    assert head(node, location, token=alice)[0] == 404
    assert patch(node, location, 20, UPDATE[20:], token=alice)[0] == 404


def with_nan(blob: bytes) -> bytes:
    bad = bytearray(blob)
    bad[HEADER_END + 4 : HEADER_END + 8] = np.array([np.nan], np.float32).tobytes()
    return bytes(bad)


@pytest.mark.slow
def test_the_blob_is_validated_as_its_bytes_arrive_and_a_refusal_drops_the_upload(node: RunningNode) -> None:
    make_job(node, goal=3)
    baseline = reserved_bytes(node)
    wrong_tensor = fmt.encode({"w": np.zeros((64, 64), np.float32), "bias": np.zeros(64, np.float32)})
    cases = [  # client, blob, the PATCH's bytes, headers -> status, code
        ("nan", with_nan(UPDATE), len(UPDATE), {}, 422, "non_finite"),
        ("header", wrong_tensor, len(wrong_tensor), {}, 422, "missing_tensor"),
        ("future", UPDATE, HEADER_END, {"X-Lifl-Base-Version": "9"}, 409, "version_conflict"),  # the admission's, as a POST's
    ]
    for client, blob, end, headers, want, code in cases:
        location = new_upload(node, client=client, length=len(blob), **headers)
        assert patch(node, location, 0, blob[:HEADER_END // 2])[0] == 204
        status, _, body = patch(node, location, HEADER_END // 2, blob[HEADER_END // 2 : end])
        assert (status, body["error"]["code"]) == (want, code), client
        assert head(node, location)[0] == 404, "nothing of a refused blob is kept"
    assert node.push("j", UPDATE, client="first")[0] == 202
    location = new_upload(node, client="first")  # the same client again: refused as its second update is
    status, _, body = patch(node, location, 0, UPDATE[:HEADER_END])
    assert (status, body["error"]["code"]) == (409, "already_acknowledged")
    assert head(node, location)[0] == 404
    rnd = round_status(node)
    assert (rnd["received"], rnd["in_progress"]) == (1, 0)
    assert {"non_finite": 1, "missing_tensor": 1, "version_conflict": 1, "already_acknowledged": 1}.items() \
        <= rnd["rejected"].items()
    wait_for(lambda: reserved_bytes(node) <= baseline + len(UPDATE) * 4, what="refused uploads' memory to be given back")


# -- the SDK ----------------------------------------------------------------------------------------
BIG = {"w": np.random.default_rng(7).standard_normal((1024, 1024)).astype(np.float32), "b": np.zeros(64, np.float32)}


def big_job(node: RunningNode, path: Path, blob: bytes | bytearray) -> None:
    """A job of BIG's tensors, and an update of it in ``path``."""
    model = {name: np.zeros_like(value) for name, value in BIG.items()}
    assert node.json("POST", "/v1/jobs", {"job": "big", "goal": 2})[0] == 201
    assert node.json("PUT", "/v1/jobs/big/model", fmt.encode(model))[0] == 201
    path.write_bytes(blob)


def push_through(proxy: CuttingProxy, path: Path) -> dict[str, Any]:
    """``push_file`` through ``proxy``, which breaks its first connection."""
    gateway = Gateway(proxy.address, retry=RetryPolicy(base_delay_s=0.05))
    try:
        return gateway.push_file("big", path, samples=4, base_version=0, client="c1")
    finally:
        gateway.close()
        proxy.close()


@pytest.mark.slow
def test_sdk_push_file_resumes_sending_only_the_rest(node: RunningNode, tmp_path: Path) -> None:
    path = tmp_path / "update.safetensors"
    big_job(node, path, fmt.encode(BIG))
    size = path.stat().st_size
    proxy = CuttingProxy(node.http, cut_after=size // 2, direction=UP)
    result = push_through(proxy, path)
    assert proxy.cut == 1 and result["version"] == 0 and result["resumes"] == 1
    heads = proxy.passed[UP] - size  # every byte of the file crossed once: the rest is request heads
    assert 0 <= heads < 4096, f"{heads} bytes beyond the file: the resume sent more than the rest"
    assert heads < math.ceil(size * 0.01)
    assert result["sent_bytes"] >= size
    wait_for(lambda: round_status(node, "big")["received"] == 1, what="the update in its round")


@pytest.mark.slow
def test_sdk_push_file_finds_the_answer_it_lost(node: RunningNode, tmp_path: Path) -> None:
    path = tmp_path / "update.safetensors"
    big_job(node, path, fmt.encode(BIG))
    proxy = CuttingProxy(node.http, direction=DOWN, cut_at=b"HTTP/1.1 202")  # the last byte went; its answer did not
    result = push_through(proxy, path)
    assert (proxy.cut, result["version"], result["resumes"]) == (1, 0, 1)
    assert proxy.passed[UP] - path.stat().st_size < 4096, "the resume found the upload complete and sent nothing again"
    assert round_status(node, "big")["received"] == 1


@pytest.mark.slow
def test_sdk_push_file_stops_at_a_refusal(node: RunningNode, tmp_path: Path) -> None:
    path = tmp_path / "update.safetensors"
    blob = fmt.encode(BIG)
    start = fmt.PREFIX_BYTES + int.from_bytes(blob[:8], "little")
    blob[start + 4 : start + 8] = np.array([np.inf], np.float32).tobytes()  # the first tensor's second float
    big_job(node, path, blob)
    gateway = Gateway(node.http)
    with pytest.raises(Unprocessable) as info:
        gateway.push_file("big", path, samples=4, base_version=0, client="c1")
    gateway.close()
    assert info.value.code == "non_finite"
    assert round_status(node, "big")["rejected"] == {"non_finite": 1}
    with pytest.raises(ValueError):
        Gateway(node.grpc, protocol="grpc").push_file("big", path, samples=4, base_version=0)
