"""HTTP ranges of model downloads: the grammar (lifl.net.ranges, with tables), the gateway's
answers on a real node, and the SDK's download that resumes with them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import RunningNode
from lifl import format as fmt
from lifl.bench.cutting import DOWN, CuttingProxy
from lifl.client import Gateway
from lifl.errors import BadRequest, RangeNotSatisfiable
from lifl.net.ranges import ByteRange, parse_content_range, requested_range

SIZE = 100
ETAG = '"7"'

SERVED = [  # Range, If-Range -> the bytes served (None: all of them, 200)
    (None, None, None),
    ("bytes=0-9", None, (0, 9)),
    ("bytes=10-", None, (10, 99)),
    ("bytes=-4", None, (96, 99)),
    ("bytes=-1000", None, (0, 99)),  # a suffix longer than the whole: all of it, as a 206
    ("bytes=90-1000", None, (90, 99)),  # a last byte past the end is the end
    ("bytes=99-99", None, (99, 99)),
    ("BYTES=0-0", None, (0, 0)),  # the unit is case-insensitive
    ("bytes=0-1,4-5", None, (0, 1)),  # several ranges: the first alone
    ("bytes= 3-4 ,, 6-7", None, (3, 4)),  # optional spaces and empty list elements
    ("items=0-5", None, None),  # another unit: ignored
    ("bytes=0-9", ETAG, (0, 9)),  # If-Range naming this version
    ("bytes=0-9", '"6"', None),  # ... or another one: the whole new model
    ("bytes=0-9", "Sat, 28 Nov 2026 09:29:26 GMT", None),  # a date: the model has no date to compare
]

REFUSED = [  # Range -> error, code
    ("bytes=100-", RangeNotSatisfiable, "range_not_satisfiable"),
    ("bytes=100-200", RangeNotSatisfiable, "range_not_satisfiable"),
    ("bytes=-0", RangeNotSatisfiable, "range_not_satisfiable"),
    ("bytes=200-300,0-1", RangeNotSatisfiable, "range_not_satisfiable"),  # the first range is the one served
    ("bytes=5-2", BadRequest, "bad_range"),
    ("bytes=abc", BadRequest, "bad_range"),
    ("bytes=", BadRequest, "bad_range"),
    ("bytes=,", BadRequest, "bad_range"),
    ("bytes=-", BadRequest, "bad_range"),
    ("bytes=--1", BadRequest, "bad_range"),
    ("bytes=1-2-3", BadRequest, "bad_range"),
    ("bytes=+1-2", BadRequest, "bad_range"),
    ("bytes=0x1-2", BadRequest, "bad_range"),
    ("bytes=0-1,zz", BadRequest, "bad_range"),  # every range must be well formed
    ("bytes=1" + "0" * 19 + "-", BadRequest, "bad_range"),  # 20 digits: no byte of anything
    ("bytes 0-5", BadRequest, "bad_range"),
    ("0-5", BadRequest, "bad_range"),
    ("=0-5", BadRequest, "bad_range"),
    ("by tes=0-5", BadRequest, "bad_range"),
]


@pytest.mark.parametrize(("value", "if_range", "served"), SERVED)
def test_requested_range(value: str | None, if_range: str | None, served: tuple[int, int] | None) -> None:
    got = requested_range(value, if_range, SIZE, ETAG)
    assert got == (None if served is None else ByteRange(*served, SIZE))


@pytest.mark.parametrize(("value", "error", "code"), REFUSED)
def test_malformed_or_unsatisfiable_ranges_are_refused_with_their_code(value: str, error: type, code: str) -> None:
    with pytest.raises(error) as info:
        requested_range(value, None, SIZE, ETAG)
    assert info.value.code == code
    if error is RangeNotSatisfiable:
        assert info.value.extra == {"size": SIZE}


def test_a_served_range_says_what_it_holds() -> None:
    part = ByteRange(10, 19, SIZE)
    assert (part.length, part.content_range()) == (10, "bytes 10-19/100")
    assert parse_content_range(part.content_range()) == part


@pytest.mark.parametrize("value", [None, "", "bytes */100", "bytes 5-4/100", "bytes 0-100/100", "items 0-1/2", "bytes 0-1"])
def test_a_content_range_that_names_no_range_is_refused(value: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_content_range(value)
    assert info.value.code == "bad_content_range"


# -- on a real node --------------------------------------------------------------------------------
MODEL = {"w": np.arange(3000, dtype=np.float32), "b": np.ones(7, np.float32)}
BLOB = fmt.encode(MODEL)


@pytest.fixture
def job(node: RunningNode) -> str:
    assert node.json("POST", "/v1/jobs", {"job": "r", "goal": 1})[0] == 201
    assert node.json("PUT", "/v1/jobs/r/model", BLOB)[0] == 201
    return "r"


@pytest.mark.slow
def test_model_downloads_answer_ranges(node: RunningNode, job: str) -> None:
    size = len(BLOB)
    status, headers, body = node.request("GET", "/v1/jobs/r/model")
    assert (status, body, headers["Accept-Ranges"], headers["ETag"]) == (200, BLOB, "bytes", '"0"')
    cases = [  # Range, If-Range -> status, Content-Range, body
        ("bytes=0-9", None, 206, f"bytes 0-9/{size}", BLOB[:10]),
        (f"bytes={size - 5}-", None, 206, f"bytes {size - 5}-{size - 1}/{size}", BLOB[-5:]),
        ("bytes=-3", None, 206, f"bytes {size - 3}-{size - 1}/{size}", BLOB[-3:]),
        ("bytes=100-199, 0-1", None, 206, f"bytes 100-199/{size}", BLOB[100:200]),
        ("bytes=0-9", '"0"', 206, f"bytes 0-9/{size}", BLOB[:10]),
        ("bytes=0-9", '"5"', 200, None, BLOB),
        ("items=0-9", None, 200, None, BLOB),
        (f"bytes={size}-", None, 416, f"bytes */{size}", None),
        ("bytes=-0", None, 416, f"bytes */{size}", None),
        ("bytes=9-0", None, 400, None, None),
        ("bytes=nine", None, 400, None, None),
    ]
    for value, if_range, want, content_range, want_body in cases:
        extra = {"Range": value, **({"If-Range": if_range} if if_range else {})}
        status, headers, body = node.request("GET", "/v1/jobs/r/model", None, extra)
        assert (status, headers.get("Content-Range")) == (want, content_range), (value, if_range, body[:200])
        if want_body is not None:
            assert body == want_body and headers["X-Lifl-Version"] == "0", (value, if_range)
        elif want == 416:
            assert b'"range_not_satisfiable"' in body and f'"size": {size}'.encode() in body
        else:
            assert b'"bad_range"' in body


@pytest.mark.slow
def test_sdk_download_resumes_from_the_bytes_written(node: RunningNode, job: str, tmp_path: Path) -> None:
    proxy = CuttingProxy(node.http, cut_after=len(BLOB) // 2, direction=DOWN)  # the answer's head, and about half the model
    gateway = Gateway(proxy.address)
    try:
        version = gateway.download_model(job, tmp_path / "model.safetensors")
    finally:
        gateway.close()
        proxy.close()
    assert proxy.cut == 1 and version == 0
    assert (tmp_path / "model.safetensors").read_bytes() == BLOB
    assert proxy.passed[DOWN] < len(BLOB) + 1024, "the second request asked for the rest, not the whole model again"
