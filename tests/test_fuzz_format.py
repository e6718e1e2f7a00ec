"""Fuzzing the update format's parsers (hypothesis; `make fuzz` runs the long profile).

Invariants: the parsers raise nothing but lifl errors with a 4xx status; the streaming receiver
(BlobSink) refuses exactly the blobs that whole-blob validation refuses, and admits (asks the
agent for memory) only blobs whose header is valid and matches the job's model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import mutated
from lifl import format as fmt
from lifl import kernels
from lifl.errors import LiflError
from lifl.gateway.ingest import BlobSink, LayoutCache
from lifl.store import MappingCache

pytestmark = pytest.mark.fuzz

LIMIT = 1 << 20
DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64}
MAPPINGS = MappingCache()  # one for the whole run: it bounds the mappings (and descriptors) it keeps
SPEC = fmt.parse_layout(fmt.encode({"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int64)})).spec()

# Bytes that tend to matter to a JSON header or a length prefix.
INTERESTING = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"\\u0000", b"\\ud800", b"-", b"0", b"1e999", b"NaN",
               b"9" * 30, b"\x00", b"\xff", b"\xc3", b" ", b"__metadata__", b"dtype", b"shape", b"data_offsets"]


def refused(e: Exception) -> bool:
    return isinstance(e, LiflError) and 400 <= e.status < 500


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, np.ndarray]:
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True))
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        out[name] = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=dtype).reshape(shape)
    return out


# Small blobs (their headers are far below a model's header bound, where the receiver would differ).
BLOBS = st.one_of(
    st.binary(max_size=256),
    tensors().map(lambda t: bytes(fmt.encode(t))),
    tensors().map(lambda t: bytes(fmt.encode(t))).flatmap(lambda b: mutated(b, INTERESTING)),
    st.just(bytes(fmt.encode({"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int64)}))).flatmap(lambda b: mutated(b, INTERESTING)),
)


@given(prefix=st.binary(min_size=8, max_size=8), limit=st.integers(0, 1 << 40), max_header=st.integers(2, fmt.MAX_HEADER_BYTES))
def test_header_length_is_bounded_or_refused(prefix: bytes, limit: int, max_header: int) -> None:
    try:
        n = fmt.header_length(prefix, limit, max_header=max_header)
    except Exception as e:
        assert refused(e), repr(e)
        return
    assert 2 <= n <= max_header and fmt.PREFIX_BYTES + n <= limit


def _check_layout(layout: fmt.Layout, header_len: int) -> None:
    """What a parsed layout promises: contiguous tensors from offset 0, sizes that fit their shapes."""
    assert layout.header_len == header_len
    cursor = 0
    for e in layout.entries:
        assert e.begin == cursor and e.end - e.begin == e.spec.nbytes
        assert 1 <= len(e.spec.name.encode()) <= fmt.MAX_NAME_BYTES
        cursor = e.end
    json.dumps(layout.metadata).encode()  # writable wherever it goes next


@given(header=st.one_of(st.binary(max_size=512), BLOBS.map(lambda b: b[8:]),
                        st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                                     lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                                     max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_parse_header_accepts_or_refuses(header: bytes) -> None:
    try:
        layout = fmt.parse_header(header, limit=LIMIT)
    except Exception as e:
        assert refused(e), repr(e)
        return
    _check_layout(layout, len(header))


@pytest.mark.parametrize("header", [
    b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting deeper than the JSON parser recurses
    b'{"a": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 4]}}',  # a 5000-digit number
    b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',  # a lone surrogate as a name
    b'{"__metadata__": {"k": "\\udfff"}}',
    b'{"a": {"dtype": "F32", "shape": [' + b"4294967296, " * 31 + b'1], "data_offsets": [0, 4]}}',  # 2^992 bytes
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1' + b"0" * 4000 + b"]}}",
    b'{"a": {"dtype": ' + json.dumps(["x"] * 10_000).encode() + b', "shape": [1], "data_offsets": [0, 4]}}',
], ids=["deep", "long-number", "surrogate-name", "surrogate-metadata", "huge-shape", "huge-offset", "huge-dtype"])
def test_what_crashed_json_header_parsers_is_refused(header: bytes) -> None:
    with pytest.raises(LiflError) as info:
        fmt.parse_header(header)
    assert refused(info.value) and len(info.value.message) < 2000


def _admit_into_memory(layout: fmt.Layout, admitted: list[fmt.Layout]) -> tuple[bytes, int]:
    admitted.append(layout)
    fd = os.memfd_create("fuzz-blob")
    os.ftruncate(fd, layout.total_size)
    return b"k" * 16, fd


@given(blob=BLOBS, cuts=st.lists(st.integers(1, 64), max_size=40), match=st.booleans())
def test_streaming_receiver_agrees_with_whole_blob_validation(blob: bytes, cuts: list[int], match: bool) -> None:
    spec = SPEC if match else None
    admitted: list[fmt.Layout] = []
    sink = BlobSink(limit=LIMIT, spec=spec, admit=lambda layout: _admit_into_memory(layout, admitted),
                    mappings=MAPPINGS, layouts=LayoutCache())
    pieces, at = [], 0
    for cut in cuts:  # arbitrary chunk edges, as a socket delivers them
        pieces.append(blob[at : at + cut])
        at += cut
    pieces.append(blob[at:])
    try:
        for piece in pieces:
            sink.write(piece)
        sink.check_complete()
        streamed: Exception | None = None
    except Exception as e:
        assert refused(e), repr(e)
        streamed = e
    try:
        whole = kernels.validate(blob, spec, limit=LIMIT)
        if spec is None and not whole.entries:
            raise LiflError("a model needs a tensor")  # what the model path adds
    except Exception as e:
        assert isinstance(e, LiflError), repr(e)
        header_ok = _header_accepted(blob, spec)
        assert streamed is not None, f"the stream accepted what validation refuses: {e!r}"
        assert bool(admitted) == header_ok  # memory only for a header that is valid and matches
        return
    assert streamed is None, f"the stream refused a valid blob: {streamed!r}"
    assert admitted == [whole] and sink.layout == whole


def _header_accepted(blob: bytes, spec: fmt.ModelSpec | None) -> bool:
    try:
        n = fmt.header_length(blob[:8], LIMIT, max_header=spec.max_header_bytes if spec else fmt.MAX_HEADER_BYTES)
        if len(blob) < 8 + n:
            return False
        LayoutCache().validate(blob[8 : 8 + n], spec, LIMIT)
    except LiflError:
        return False
    return True

