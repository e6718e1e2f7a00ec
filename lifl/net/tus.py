"""The wire format of resumable uploads: the headers of the tus 1.0 protocol
(https://tus.io/protocols/resumable-upload; its core, ``creation``, ``expiration`` and
``termination``), read strictly. Pure functions of header values (lower-case names, as
gateway/http.py parses them): the gateway checks requests with them (gateway/resumable.py)
and the SDK speaks the same version and media type (lifl.client).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lifl.errors import BadRequest, PreconditionFailed, UnsupportedMediaType

VERSION = "1.0.0"
EXTENSIONS = "creation,expiration,termination"
OFFSET_STREAM = "application/offset+octet-stream"  # a PATCH's body: bytes at the upload's offset
_BYTE_COUNT = re.compile(r"[0-9]{1,18}")  # as Content-Length (gateway/http.py): ASCII digits only
_METADATA_KEY = re.compile(r"[!-+\--~]+")  # visible ASCII but the comma
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def check_version(headers: Mapping[str, str]) -> None:
    """PreconditionFailed (412) unless the request speaks this version (``Tus-Resumable``): the
    protocol says a server must not act on a request of another."""
    sent = headers.get("tus-resumable")
    if sent != VERSION:
        said = f"it sent {sent[:32]!r}" if sent is not None else "it sent none"
        raise PreconditionFailed(f"resumable uploads speak tus {VERSION}: send 'Tus-Resumable: {VERSION}' ({said})",
                                 code="unsupported_version")


def byte_count(headers: Mapping[str, str], name: str) -> int:
    """The value of header ``name`` (``Upload-Length``, ``Upload-Offset``): required, and a byte
    count in ASCII digits (no sign, no spaces inside, at most 18 digits)."""
    value = headers.get(name.lower())
    if value is None:
        raise BadRequest(f"this request needs the header {name}", code="bad_header")
    if not _BYTE_COUNT.fullmatch(value):
        raise BadRequest(f"{name} must be a byte count of 1-18 ASCII digits, got {value[:32]!r}", code="bad_header")
    return int(value)


def check_patch_type(headers: Mapping[str, str]) -> None:
    """UnsupportedMediaType (415) unless the body is ``application/offset+octet-stream``."""
    sent = headers.get("content-type")
    media_type = (sent or "").partition(";")[0].strip(" \t").lower()
    if media_type != OFFSET_STREAM:
        raise UnsupportedMediaType(f"a PATCH's body must be sent as Content-Type: {OFFSET_STREAM}, got {sent!r:.64}",
                                   code="bad_content_type")


def check_metadata(value: str) -> str:
    """``Upload-Metadata`` as sent ("" if none), once checked: comma-separated ``key`` or ``key
    base64-value`` pairs with distinct keys. The gateway keeps it as it is (it takes the update's
    fields from the X-Lifl-* headers) and answers it back on HEAD, as the protocol asks."""
    keys: set[str] = set()
    for pair in value.split(",") if value else ():
        key, _, encoded = pair.strip(" \t").partition(" ")
        if not _METADATA_KEY.fullmatch(key) or not _BASE64.fullmatch(encoded):
            raise BadRequest(f"Upload-Metadata must be comma-separated 'key base64-value' pairs, got {pair[:64]!r}",
                             code="bad_header")
        if key in keys:
            raise BadRequest(f"Upload-Metadata names {key[:64]!r} twice", code="bad_header")
        keys.add(key)
    return value
