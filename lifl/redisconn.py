"""redis-py's defaults that lifl overrides, named: bulk clients' timeout, and SCAN's batch.

redis-py 8 gives every command a 5 s socket timeout unless told otherwise. A command carrying
an update of hundreds of MB, queued behind others on a busy server of a loaded 2-core machine,
takes longer than that, and a write cut halfway loses the value. The node's round protocol
uses its own short limits (lifl.state); these clients wait this long instead.
"""

from __future__ import annotations

import redis

SCAN_COUNT = 1000  # keys one SCAN call looks at: redis-py's default (10) takes a call per 10 keys of the whole keyspace
BULK_TIMEOUT_S = 300.0  # one command moving a value of any size; a dead server fails at once (connection refused)


def bulk_client(url: str) -> redis.Redis:
    """A client whose commands may each take up to BULK_TIMEOUT_S."""
    return redis.Redis.from_url(url, socket_timeout=BULK_TIMEOUT_S, socket_connect_timeout=BULK_TIMEOUT_S)
