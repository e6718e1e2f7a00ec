"""How lifl talks to Redis where redis-py's defaults do not fit: bulk clients' timeout, SCAN's
batch, and how long a call that needs the cluster state may wait.

redis-py 8 gives every command a 5 s socket timeout unless told otherwise. A command carrying
an update of hundreds of MB, queued behind others on a busy server of a loaded 2-core machine,
takes longer than that, and a write cut halfway loses the value: bulk clients wait
BULK_TIMEOUT_S. The round protocol's calls wait STATE_TIMEOUT_S, so that a stopped (not dead)
server makes a request answer 503 soon instead of hanging (docs/state.md).
"""

from __future__ import annotations

import os

import redis

SCAN_COUNT = 1000  # keys one SCAN call looks at: redis-py's default (10) takes a call per 10 keys of the whole keyspace
BULK_TIMEOUT_S = 300.0  # one command moving a value of any size; a dead server fails at once (connection refused)
STATE_TIMEOUT_ENV = "LIFL_STATE_TIMEOUT_S"
DEFAULT_STATE_TIMEOUT_S = 1.5  # a call needing Redis answers 503 within 2 s of a freeze (the rest: the node's own work)
MAX_STATE_TIMEOUT_S = 60.0


def state_timeout(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """Seconds a cluster-state command waits for Redis's answer: $LIFL_STATE_TIMEOUT_S, or the default."""
    text = environ.get(STATE_TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_STATE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{STATE_TIMEOUT_ENV}={text!r}: expected seconds, a number") from None
    if not 0 < value <= MAX_STATE_TIMEOUT_S:
        raise ValueError(f"{STATE_TIMEOUT_ENV}={text!r}: expected more than 0 and at most {MAX_STATE_TIMEOUT_S:g} seconds")
    return value


STATE_TIMEOUT_S = state_timeout()


def bulk_client(url: str) -> redis.Redis:
    """A client whose commands may each take up to BULK_TIMEOUT_S."""
    return redis.Redis.from_url(url, socket_timeout=BULK_TIMEOUT_S, socket_connect_timeout=BULK_TIMEOUT_S)
