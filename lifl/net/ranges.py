"""HTTP byte ranges (RFC 9110, section 14) of a model download: which bytes a ``Range`` asks
for, whether its ``If-Range`` still holds, and the ``Content-Range`` that says what an answer
holds. Pure functions of header values: the gateway serves ranges (gateway/http.py) and the
SDK resumes a download with them (lifl.client), so both read the same grammar.

One range is served: a ``Range`` of several is answered with its first alone (a single-part
206 whose ``Content-Range`` says which), never as multipart/byteranges; a client that asked for
more asks again from where the answer ends. A malformed ``bytes`` range is refused (400
``bad_range``) rather than ignored, as the gateway refuses every malformed input; a range unit
other than ``bytes`` is ignored, as RFC 9110 asks, and the whole representation is sent.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lifl.errors import BadRequest, RangeNotSatisfiable

UNIT = "bytes"
_POSITION = "[0-9]{1,19}"  # longer digit strings are refused, not parsed: they cannot address a byte of anything here
_RANGE_SPEC = re.compile(f"(?:({_POSITION})-({_POSITION})?|-({_POSITION}))")
_UNIT_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a range unit is a token (RFC 9110, 14.1)
_CONTENT_RANGE = re.compile(f"bytes ({_POSITION})-({_POSITION})/({_POSITION})")
_OWS = " \t"


class ByteRange(NamedTuple):
    """Bytes ``first`` to ``last`` inclusive of a representation of ``size`` bytes."""

    first: int
    last: int
    size: int

    @property
    def length(self) -> int:
        return self.last - self.first + 1

    def content_range(self) -> str:
        return f"{UNIT} {self.first}-{self.last}/{self.size}"


def requested_range(range_value: str | None, if_range: str | None, size: int, etag: str) -> ByteRange | None:
    """The bytes of a representation of ``size`` bytes (strong entity tag ``etag``) that a request
    with these ``Range`` and ``If-Range`` values gets: None for all of it (no Range, another unit,
    or an ``If-Range`` that names another tag or a date: the representation changed, or may
    have), else its first range. BadRequest (``bad_range``) for a malformed ``bytes`` range,
    RangeNotSatisfiable when the first range starts at or past ``size`` (or is an empty suffix)."""
    if range_value is None:
        return None
    unit, sep, ranges = range_value.partition("=")
    unit = unit.strip(_OWS)
    if sep and unit.lower() != UNIT and _UNIT_TOKEN.fullmatch(unit):
        return None  # another range unit: ignored (RFC 9110, 14.2)
    if not sep or unit.lower() != UNIT:
        raise BadRequest(f"Range must be 'bytes=first-last', 'bytes=first-' or 'bytes=-suffix', got {range_value[:64]!r}",
                         code="bad_range")
    specs = [spec.strip(_OWS) for spec in ranges.split(",")]
    specs = [spec for spec in specs if spec]  # empty list elements are allowed (RFC 9110, 5.6.1)
    if not specs:
        raise BadRequest(f"Range {range_value[:64]!r} names no range", code="bad_range")
    parsed = [_range_spec(spec) for spec in specs]  # every range must be well formed, though one is served
    if if_range is not None and if_range.strip(_OWS) != etag:
        return None
    first, last = parsed[0]
    if first is None:  # a suffix: the last ``last`` bytes
        if last == 0:
            raise RangeNotSatisfiable(f"Range {specs[0]!r} asks for no bytes", extra={"size": size})
        return ByteRange(max(0, size - last), size - 1, size)
    if first >= size:
        raise RangeNotSatisfiable(f"Range {specs[0]!r} starts at byte {first}, past the end of the {size} bytes",
                                  extra={"size": size})
    return ByteRange(first, size - 1 if last is None else min(last, size - 1), size)


def _range_spec(spec: str) -> tuple[int | None, int | None]:
    """(first, last) of ``first-last`` or ``first-`` (last None), (None, suffix) of ``-suffix``."""
    match = _RANGE_SPEC.fullmatch(spec)
    if match is None:
        raise BadRequest(f"bad byte range {spec[:64]!r}: expected first-last, first- or -suffix in ASCII digits",
                         code="bad_range")
    first, last, suffix = match.groups()
    if suffix is not None:
        return None, int(suffix)
    if last is not None and int(last) < int(first):
        raise BadRequest(f"bad byte range {spec!r}: its last byte comes before its first", code="bad_range")
    return int(first), None if last is None else int(last)


def parse_content_range(value: str | None) -> ByteRange:
    """The range a 206 answer holds, from its ``Content-Range``; BadRequest if it says none."""
    match = _CONTENT_RANGE.fullmatch((value or "").strip(_OWS))
    if match is None:
        raise BadRequest(f"a partial answer's Content-Range must be 'bytes first-last/size', got {value!r}",
                         code="bad_content_range")
    first, last, size = (int(g) for g in match.groups())
    if not first <= last < size:
        raise BadRequest(f"Content-Range {value!r} is not within its size", code="bad_content_range")
    return ByteRange(first, last, size)
