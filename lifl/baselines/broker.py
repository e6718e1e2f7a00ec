"""The message broker of SF-micro and SL: Redis streams on the real redis-server.

Updates of a round are appended to the round's stream (``bl:updates:{job}:{version}``) and a
small event announces each (``bl:events``), so consumers learn what arrived without pulling
bytes; they read a round's entries when they aggregate them (SF-micro's leaf at once, SL's
dispatcher once a batch is complete) and the stream is deleted with its round. Partial sums of
SL's leaves go through the broker the same way (``bl:partials:{job}:{version}``).
"""

from __future__ import annotations

from collections.abc import Iterator

from lifl.baselines.aggregate import Input
from lifl.redisconn import bulk_client

EVENTS = "bl:events"
EVENTS_KEPT = 10_000  # announcements are tiny; a consumer that falls this far behind re-reads streams by length
UPDATES, PARTIALS = "updates", "partials"


def stream(kind: str, job: str, version: int) -> str:
    return f"bl:{kind}:{job}:{version}"


class Broker:
    def __init__(self, url: str) -> None:
        self.redis = bulk_client(url)  # XREAD blocks for less than its timeout

    def publish(self, kind: str, job: str, version: int, item: Input) -> None:
        """Append an input to its round's stream and announce it."""
        with self.redis.pipeline(transaction=False) as p:
            p.xadd(stream(kind, job, version), {"samples": item.samples, "updates": item.updates,
                                                "partial": int(item.partial), "blob": bytes(item.blob)
                                                if isinstance(item.blob, memoryview) else item.blob})
            p.xadd(EVENTS, {"kind": kind, "job": job, "version": version}, maxlen=EVENTS_KEPT, approximate=True)
            p.execute()

    def events(self, after: str, block_ms: int) -> Iterator[tuple[str, str, str, int]]:
        """(event id, kind, job, version) announced after ``after``, waiting up to ``block_ms``."""
        for _, entries in self.redis.xread({EVENTS: after}, block=block_ms) or []:
            for entry_id, fields in entries:
                yield entry_id.decode(), fields[b"kind"].decode(), fields[b"job"].decode(), int(fields[b"version"])

    def last_event(self) -> str:
        """Where a consumer starting now begins: after everything announced so far."""
        entries = self.redis.xrevrange(EVENTS, count=1)
        return entries[0][0].decode() if entries else "0-0"

    def length(self, kind: str, job: str, version: int) -> int:
        return int(self.redis.xlen(stream(kind, job, version)))

    def read(self, kind: str, job: str, version: int, after: str, count: int) -> list[tuple[str, Input]]:
        """Up to ``count`` inputs of a round after entry ``after`` ("0-0": from the start)."""
        entries = self.redis.xrange(stream(kind, job, version), min=f"({after}" if after != "0-0" else "-", count=count)
        return [(entry_id.decode(), Input(f[b"blob"], int(f[b"samples"]), int(f[b"updates"]), bool(int(f[b"partial"]))))
                for entry_id, f in entries]

    def drop(self, kind: str, job: str, version: int) -> None:
        self.redis.delete(stream(kind, job, version))
