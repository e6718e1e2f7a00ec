"""Receiving one blob as it streams in, straight into shared memory.

The first 8 + N bytes (length and JSON header) go to a buffer that grows as they arrive
(never to the size the prefix claims) and are validated against the job's model before
anything is admitted; only then does the agent hand out a shared-memory object (reserving a
slot of the round, checking the budgets), and every later byte is received directly into it.
Floats are checked for NaN/Inf chunk by chunk while the bytes are still in cache. Any failure
aborts the object, so nothing of a bad blob survives.

Admission may be immediate (``admit`` returns the object) or under way (``admit`` returns None:
an event loop asked the agent and goes on with other work): the sink is not ``ready`` for
bytes until ``admitted`` hands it the object.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from lifl import format as fmt
from lifl.errors import BadRequest, Internal, PayloadTooLarge, Unprocessable
from lifl.kernels import FiniteChecker
from lifl.store import MappingCache

CHECK_EVERY = 256 << 10  # check finiteness every 256 KiB received, while it is hot in L2
HEADER_STEP = 64 << 10  # a JSON header is received this much at a time: memory follows the bytes, not the claim
LAYOUT_CACHE_BYTES = 32 << 20  # what the cached layouts may take (estimated as below)
LAYOUT_ENTRY_BYTES = 400  # measured memory of one tensor's entry in a parsed layout, besides its header bytes
IDLE_CHECKERS = 8  # finiteness checkers kept per cached layout for the next blobs with that header


class LayoutCache:
    """Validated layouts of admitted blobs, by a digest of their exact header bytes: clients of
    one job send the same header with every update, and validating it (JSON, offsets, the
    model's tensors) is deterministic. Bounded by bytes; a refused blob's layout is never kept
    (so distinct headers cannot fill the gateway's memory).

    A cached layout also keeps the finiteness checkers of its finished blobs (``checker``,
    ``give_back``): making one costs more than receiving a small update's bytes."""

    def __init__(self, max_bytes: int = LAYOUT_CACHE_BYTES) -> None:
        self._entries: OrderedDict[tuple[bytes, int, bool], tuple[fmt.ModelSpec | None, fmt.Layout, int]] = OrderedDict()
        self._idle: dict[int, tuple[fmt.Layout, list[FiniteChecker]]] = {}  # by the id of a cached layout (kept alive here)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def cost(header: bytes | bytearray, layout: fmt.Layout) -> int:
        """Estimated memory of a cached layout."""
        return len(header) + LAYOUT_ENTRY_BYTES * len(layout.entries)

    @staticmethod
    def _key(header: bytes | bytearray, spec: fmt.ModelSpec | None, partial: bool) -> tuple[bytes, int, bool]:
        return hashlib.blake2b(header, digest_size=32).digest(), id(spec), partial

    def validate(self, header: bytes | bytearray, spec: fmt.ModelSpec | None, limit: int, partial: bool = False) -> fmt.Layout:
        """The layout of ``header``, checked against ``spec`` (``partial``: ``spec`` is that of a
        partial sum, in accumulator dtypes, from another node); raises what the blob is refused for."""
        key = self._key(header, spec, partial)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] is spec:
                self._entries.move_to_end(key)
                layout = hit[1]
                if layout.total_size > limit:
                    raise PayloadTooLarge(f"blob declares {layout.total_size} bytes, over the limit of {limit} bytes")
                return layout
        layout = fmt.parse_header(header, limit=limit, allow_partial=partial)
        if spec is not None:
            fmt.check_matches(layout, spec)
        elif not layout.entries:
            raise Unprocessable("a model needs at least one tensor", code="empty_model")
        return layout

    def remember(self, header: bytes | bytearray, spec: fmt.ModelSpec | None, partial: bool, layout: fmt.Layout) -> None:
        """Keep the layout of an admitted blob, evicting the least recently used beyond the bound."""
        cost = self.cost(header, layout)
        if cost > self.max_bytes:
            return
        key = self._key(header, spec, partial)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[2]
                if old[1] is not layout:
                    self._idle.pop(id(old[1]), None)
            self._entries[key] = (spec, layout, cost)
            self._idle.setdefault(id(layout), (layout, []))
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, (_, evicted, evicted_cost) = self._entries.popitem(last=False)
                self.bytes -= evicted_cost
                self._idle.pop(id(evicted), None)

    def checker(self, layout: fmt.Layout) -> FiniteChecker:
        """A finiteness checker for a blob of ``layout``, at its data's start."""
        with self._lock:
            idle = self._idle.get(id(layout))
            if idle is not None and idle[1]:
                checker = idle[1].pop()
                checker.cursor = layout.data_start
                return checker
        return FiniteChecker(layout)

    def give_back(self, layout: fmt.Layout, checker: FiniteChecker) -> None:
        """A blob of ``layout`` is checked in full: its checker may serve the next one."""
        with self._lock:
            idle = self._idle.get(id(layout))
            if idle is not None and len(idle[1]) < IDLE_CHECKERS:
                idle[1].append(checker)

    def __len__(self) -> int:
        return len(self._entries)


class BlobSink:
    def __init__(
        self,
        *,
        limit: int,
        spec: fmt.ModelSpec | None,
        admit: Callable[[fmt.Layout], tuple[bytes, int] | None],
        mappings: MappingCache,
        layouts: LayoutCache,
        expected_size: int | None = None,
        partial: bool = False,
    ) -> None:
        self._partial = partial
        self._limit = limit
        self._spec = spec
        self._admit = admit
        self._mappings = mappings
        self._layouts = layouts
        self._expected = expected_size
        self._prefix = bytearray(fmt.PREFIX_BYTES)
        self._header_len: int | None = None  # once the prefix is in
        self._header = bytearray()  # grows as the header's bytes arrive
        self._step = bytearray()  # where the next header bytes are received
        self._mm = None
        self._admitting: tuple[bytearray, fmt.Layout] | None = None  # header and layout while admission is under way
        self._checker: FiniteChecker | None = None
        self.layout: fmt.Layout | None = None
        self._total = -1  # the layout's total size, once admitted (read on every chunk received)
        self.key: bytes | None = None
        self.received = 0
        if expected_size is not None:
            if expected_size > limit:
                raise PayloadTooLarge(f"blob of {expected_size} bytes exceeds the limit of {limit} bytes")
            if expected_size < fmt.PREFIX_BYTES:
                raise BadRequest(f"blob of {expected_size} bytes is shorter than its 8-byte header length", code="truncated")

    @property
    def total(self) -> int | None:
        return self.layout.total_size if self.layout else None

    @property
    def ready(self) -> bool:
        """Whether the sink takes bytes now: not while the agent is admitting the blob."""
        return self._admitting is None

    @property
    def done(self) -> bool:
        return self.received == self._total

    @property
    def remaining(self) -> int:
        """Bytes still expected (before the header is known: at least those of the header)."""
        if self.layout is not None:
            return self.layout.total_size - self.received
        if self._header_len is None:
            return fmt.PREFIX_BYTES - self.received
        return fmt.PREFIX_BYTES + self._header_len - self.received

    def buffer(self) -> memoryview:
        """Where the next bytes of the blob go; receive into it, then call ``advance``."""
        if self._mm is not None:
            return memoryview(self._mm)[self.received : self._total]
        if self._header_len is None:
            return memoryview(self._prefix)[self.received :]
        return memoryview(self._step)[: self._header_len - len(self._header)]

    def advance(self, n: int) -> None:
        if n <= 0:
            return
        self.received += n
        if self._mm is None:
            if self._header_len is None:
                if self.received == fmt.PREFIX_BYTES:
                    self._header_len = fmt.header_length(self._prefix, self._limit, max_header=self._max_header())
                    self._step = bytearray(min(HEADER_STEP, self._header_len))
            else:
                self._header += memoryview(self._step)[:n]
                if len(self._header) == self._header_len:
                    self._on_header()
            return
        assert self._checker is not None
        if self.done:
            self._check_rest()
        elif self.received - self._checker.cursor >= CHECK_EVERY:
            self._checker.check(self._mm, self.received)

    def _max_header(self) -> int:
        """An update's header is refused unread if longer than any header of its model's tensors."""
        return fmt.MAX_HEADER_BYTES if self._spec is None else self._spec.max_header_bytes

    def write(self, data: bytes | memoryview) -> None:
        """Take bytes that are already in memory (e.g. read ahead with a request's headers)."""
        data = memoryview(data)
        while data:
            if not self.ready:
                raise Internal("the blob's bytes came before its admission was answered")
            if self.done:
                raise BadRequest(f"{len(data)} bytes follow the end of the blob", code="trailing_bytes")
            view = self.buffer()
            n = min(len(view), len(data))
            view[:n] = data[:n]
            data = data[n:]
            self.advance(n)

    def _on_header(self) -> None:
        header, self._header, self._step = self._header, bytearray(), bytearray()
        layout = self._layouts.validate(header, self._spec, self._limit, self._partial)
        if self._expected is not None and self._expected != layout.total_size:
            raise BadRequest(
                f"body has {self._expected} bytes but the blob's header declares {layout.total_size}",
                code="length_mismatch",
            )
        self._admitting = (header, layout)
        admitted = self._admit(layout)
        if admitted is not None:
            self.admitted(*admitted)

    def admitted(self, key: bytes, fd: int) -> None:
        """The object the agent admitted the blob into (``fd``, which the sink closes): the
        bytes received so far go into it, and the sink is ready for the rest."""
        assert self._admitting is not None
        header, layout = self._admitting
        self._admitting = None
        self.key = key
        self._layouts.remember(header, self._spec, self._partial, layout)  # admitted: worth keeping
        try:
            self._mm = self._mappings.map_fd(fd, writable=True)
        finally:
            os.close(fd)
        self._mm[: fmt.PREFIX_BYTES] = self._prefix
        self._mm[fmt.PREFIX_BYTES : layout.data_start] = header
        self.layout = layout
        self._total = layout.total_size
        self._checker = self._layouts.checker(layout)
        if self.done:
            self._check_rest()

    def _check_rest(self) -> None:
        """The blob is in: check what is left of it, and let its checker serve the next blob."""
        assert self._checker is not None and self.layout is not None
        self._checker.check(self._mm, self.received)
        self._layouts.give_back(self.layout, self._checker)

    def check_complete(self) -> None:
        if not self.done:
            have = self.received
            want = self.total if self.total is not None else "more"
            raise BadRequest(f"blob ended after {have} bytes, its header declares {want}", code="truncated")
