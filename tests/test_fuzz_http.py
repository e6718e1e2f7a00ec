"""Fuzzing the HTTP/1.1 front end (hypothesis; `make fuzz` runs the long profile): the pure head,
chunk-size and body-framing parsers, and a few requests end to end against a real gateway.

Invariants: nothing but lifl errors with a documented 4xx status comes out of a parser; what
is accepted is what RFC 9112 allows (no obs-fold, no controls, ASCII-digit lengths, exactly
``chunked``); a chunked body decodes to what was encoded; nothing malformed is admitted."""

from __future__ import annotations

import itertools
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import RunningNode, wait_for
from fuzzing import mutated
from lifl import format as fmt
from lifl.errors import LiflError
from lifl.gateway.http import (
    MAX_CHUNK_LINE, MAX_HEAD, MAX_HEADER_FIELDS, MAX_HEADER_LINE, Body, RequestHead, parse_chunk_size, parse_head,
)
from test_http import read_response

pytestmark = pytest.mark.fuzz


def documented_codes() -> dict[str, int]:
    """Error code -> HTTP status, from the error table of docs/api.md."""
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    codes = {}
    for status, cell in re.findall(r"^\| (\d{3}) \| (.*?) \|", text, re.M):
        for code in re.findall(r"`([a-z_]+)`(?: \((\d{3})\))?", cell):
            codes[code[0]] = int(code[1] or status)
    return codes


DOCUMENTED = documented_codes()


def check_refusal(e: Exception) -> None:
    """A refusal: a lifl error with a 4xx status and a code docs/api.md lists with that status."""
    assert isinstance(e, LiflError), repr(e)
    assert 400 <= e.status < 500 and DOCUMENTED.get(e.code) == e.status, (e.status, e.code, e.message)


# -- the head ---------------------------------------------------------------------------------
INTERESTING = [b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\x00", b"\x0b", b"\x0c", b"\x1f", b"\x7f", b"\x85", b"\xa0", b"\xb2",
               b"\xff", "٣".encode(), b" ", b"\t", b":", b";", b",", b"=", b'"', b"0", b"9", b"-", b"+", b"chunked",
               b"Content-Length: ", b"Transfer-Encoding: ", b"Connection: close\r\n", b"HTTP/1.1", b"/", b"?"]


VALID_HEADS = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/jobs/j/updates HTTP/1.1\r\nHost: x\r\nX-Lifl-Client: c\r\nX-Lifl-Samples: 5\r\n"
    b"X-Lifl-Base-Version: 0\r\nContent-Length: 120\r\nExpect: 100-continue\r\n\r\n",
    b"PUT /v1/jobs/j/model HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive, close\r\n\r\n",
    b"\r\nGET /v1/jobs/j/rounds?limit=3 HTTP/1.0\r\nConnection: keep-alive\r\nX-Empty:\r\nX-Tab:\tv\t\r\n\r\n",
]
HEADS = st.one_of(
    st.binary(max_size=300).map(lambda b: b + b"\r\n\r\n"),
    st.sampled_from(VALID_HEADS).flatmap(lambda b: mutated(b, INTERESTING)),
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")


def check_head(head: RequestHead) -> None:
    """What an accepted head promises to the handlers."""
    assert _TOKEN.fullmatch(head.method.lower()) and head.version in ("HTTP/1.0", "HTTP/1.1")
    assert head.path.startswith("/") and all(0x21 <= ord(c) <= 0x7E for c in head.path + head.query)
    assert len(head.headers) <= MAX_HEADER_FIELDS
    for name, value in head.headers.items():
        assert _TOKEN.fullmatch(name), name
        assert value == value.strip(" \t") and not any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in value)
    if head.chunked:
        assert head.headers["transfer-encoding"].lower() == "chunked" and "content-length" not in head.headers
        assert head.length is None and head.version == "HTTP/1.1"
    elif "content-length" in head.headers:
        assert re.fullmatch(r"[0-9]+", head.headers["content-length"]) and head.length == int(head.headers["content-length"])
    else:
        assert head.length is None


@given(head=HEADS)
def test_head_parser_accepts_what_rfc_9112_allows_or_refuses(head: bytes) -> None:
    try:
        parsed = parse_head(head)
    except Exception as e:
        check_refusal(e)
        return
    check_head(parsed)


@given(fields=st.integers(0, MAX_HEADER_FIELDS + 2), line=st.integers(1, MAX_HEADER_LINE + 2), pad=st.integers(0, MAX_HEAD))
def test_head_limits_hold_whatever_the_shape(fields: int, line: int, pad: int) -> None:
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(fields)) + b"X-Pad: " + b"a" * min(pad, line) + b"\r\n\r\n"
    try:
        parsed = parse_head(head)
    except Exception as e:
        check_refusal(e)
        assert len(head) > MAX_HEAD or fields + 1 > MAX_HEADER_FIELDS or 7 + min(pad, line) > MAX_HEADER_LINE
        return
    assert len(head) <= MAX_HEAD and len(parsed.headers) == fields + 1


# -- bodies ---------------------------------------------------------------------------------------
def read_body(data: bytes, length: int | None, chunked: bool, limit: int = 1 << 16, *, piece: int = 0) -> bytes:
    """What Body makes of ``data`` sent by a peer that then closes its side: fed to it as it
    comes (in pieces of ``piece`` bytes, or at once), then the end."""
    body, buf, out = Body(length, chunked), bytearray(), bytearray()
    body.check_size(limit)
    for at in range(0, len(data), piece or max(1, len(data))):
        buf += data[at : at + (piece or len(data))]
        if body.feed(buf, out, limit):
            return bytes(out)
    if body.feed(buf, out, limit):
        return bytes(out)
    raise Body.end_of_stream()


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TOKENS = st.text(TOKEN_CHARS, min_size=1, max_size=8)
QUOTED = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8).map(
    lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"')
EXTENSIONS = st.lists(st.tuples(st.sampled_from(["", " ", "\t "]), TOKENS, st.none() | TOKENS | QUOTED), max_size=3).map(
    lambda exts: "".join(f"{ws};{ws}{name}" + (f"={value}" if value is not None else "") for ws, name, value in exts).encode())


@st.composite
def chunked_bodies(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(data, its chunked encoding with arbitrary chunk sizes, extensions and trailer fields)."""
    data = draw(st.binary(max_size=4096))
    out, at = b"", 0
    while at < len(data):
        n = draw(st.integers(1, max(1, len(data) - at)))
        size = draw(st.sampled_from(["%x", "%X", "%04x"])) % n
        out += size.encode() + draw(EXTENSIONS) + b"\r\n" + data[at : at + n] + b"\r\n"
        at += n
    trailer = draw(st.lists(st.tuples(TOKENS, st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=8)), max_size=3))
    out += b"0" + draw(EXTENSIONS) + b"\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in trailer) + b"\r\n"
    return data, out


@given(body=chunked_bodies(), piece=st.integers(0, 16))
def test_chunked_body_decodes_to_what_was_encoded(body: tuple[bytes, bytes], piece: int) -> None:
    data, encoded = body
    assert read_body(encoded, None, True, piece=piece) == data


@given(encoded=chunked_bodies().flatmap(lambda b: mutated(b[1], INTERESTING)) | st.binary(max_size=512),
       piece=st.integers(0, 16))
def test_chunked_body_reader_decodes_or_refuses(encoded: bytes, piece: int) -> None:
    try:
        whole = read_body(encoded, None, True)
    except Exception as e:
        check_refusal(e)
        with pytest.raises(type(e)):  # however the bytes come
            read_body(encoded, None, True, piece=piece)
        return
    assert read_body(encoded, None, True, piece=piece) == whole


@given(data=st.binary(max_size=2048), length=st.integers(0, 4096))
def test_content_length_body_is_exactly_that_long_or_truncated(data: bytes, length: int) -> None:
    try:
        got = read_body(data, length, False, limit=4096)
    except Exception as e:
        check_refusal(e)
        assert len(data) < length and e.code == "truncated"  # type: ignore[attr-defined]
        return
    assert got == data[:length]


@given(line=st.binary(max_size=MAX_CHUNK_LINE + 8) | st.sampled_from([b"0", b"f" * 16, b"1" * 17, b"a;x", b"a;x=", b'a;x="\\"', b"a ;x=y"]))
def test_chunk_size_line_is_a_size_or_refused(line: bytes) -> None:
    try:
        size = parse_chunk_size(line)
    except Exception as e:
        check_refusal(e)
        return
    digits = re.match(rb"[0-9a-fA-F]+", line)
    assert digits is not None and size == int(digits.group(), 16) and len(digits.group()) <= 16


# -- end to end -----------------------------------------------------------------------------------
MODEL = {"w": np.zeros(16, np.float32)}
UPDATE = bytes(fmt.encode({"w": np.ones(16, np.float32)}))
CLIENTS = itertools.count()  # a client's update counts once per round: every example is another client


@pytest.fixture
def fuzz_job(node: RunningNode) -> RunningNode:
    assert node.json("POST", "/v1/jobs", {"job": "f", "goal": 100_000, "max_inflight": 100_000})[0] == 201
    assert node.json("PUT", "/v1/jobs/f/model", fmt.encode(MODEL))[0] == 201
    return node


@st.composite
def update_requests(draw: st.DrawFn) -> bytes:
    """An update with its framing (request line, Content-Length or chunked, body) mutated; the
    X-Lifl headers are kept, they are the service's to validate."""
    chunked = draw(st.booleans())
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n"
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(UPDATE), UPDATE)
    else:
        framing, body = b"Content-Length: %d\r\n" % len(UPDATE), UPDATE
    line = b"POST /v1/jobs/f/updates HTTP/1.1\r\nHost: x\r\n"
    parts = [line, framing, body]
    which = draw(st.sets(st.integers(0, 2), min_size=1))
    for i in which:
        parts[i] = draw(mutated(parts[i], INTERESTING))
    lifl_headers = b"X-Lifl-Client: fuzz%d\r\nX-Lifl-Samples: 1\r\nX-Lifl-Base-Version: 0\r\n" % next(CLIENTS)
    return parts[0] + lifl_headers + parts[1] + b"\r\n" + parts[2]


@pytest.mark.slow
@settings(max_examples=max(10, settings.default.max_examples // 10), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=update_requests())
def test_mutated_updates_end_to_end(fuzz_job: RunningNode, request: bytes) -> None:
    node = fuzz_job
    before = node.json("GET", "/v1/jobs/f")[1]["round"]["received"]
    host, port = node.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)  # the request ends here, whatever its framing says
        status, body = read_response(s)
    assert status < 500, body
    if status >= 400:
        assert DOCUMENTED.get(body["error"]["code"]) == status, body
    gateway = node.node.children["gateway"].proc
    assert gateway is not None and gateway.poll() is None
    accepted = 1 if status == 202 else 0  # only an update is answered 202
    wait_for(lambda: node.json("GET", "/v1/jobs/f")[1]["round"]["in_progress"] == 0, what="no upload left in progress")
    assert node.json("GET", "/v1/jobs/f")[1]["round"]["received"] == before + accepted
