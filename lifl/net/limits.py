"""What one peer of lifl's HTTP and gRPC servers may hold (``ConnectionLimits``): time, connections,
how fast a body must arrive, and the resumable uploads it leaves between requests. The gateway enforces them (``gateway/stream.py`` says how); its
command-line flags (``lifl.net.flags``) set them, and ``lifl up`` passes them on to the gateways
it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_TIMEOUT = 120.0  # s a connection may wait for its next request (HTTP keep-alive)
HEAD_TIMEOUT = 10.0  # s from a request's first byte to the end of its head
MIN_BODY_RATE = 1024.0  # bytes/s a request body must keep up while we wait for it (see RateMeter)...
BODY_GRACE = 10.0  # ...after this many seconds of waiting for free...
BODY_WINDOW = 10.0  # ...falling behind by at most this many seconds' worth of bytes
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_PEER = 256  # per source address; clients behind one NAT share it
RESERVED_CONNECTIONS = 32  # beyond the limits, for requests a front end answers cheaply
UPLOAD_IDLE = 300.0  # s an incomplete resumable upload is kept without a PATCH (tus Upload-Expires)
MAX_UPLOADS = 1024  # incomplete resumable uploads one gateway holds (each may hold a round slot and memory)
MAX_UPLOADS_PER_PRINCIPAL = 4  # ... of one caller: a client sends one update a round


@dataclass(frozen=True)
class ConnectionLimits:
    idle_timeout: float = IDLE_TIMEOUT
    head_timeout: float = HEAD_TIMEOUT
    min_body_rate: float = MIN_BODY_RATE  # 0: no minimum
    body_grace: float = BODY_GRACE
    body_window: float = BODY_WINDOW
    max_connections: int = MAX_CONNECTIONS
    max_per_peer: int = MAX_CONNECTIONS_PER_PEER
    reserved: int = RESERVED_CONNECTIONS
    upload_idle: float = UPLOAD_IDLE  # HTTP only: resumable uploads (gateway/resumable.py)
    max_uploads: int = MAX_UPLOADS
    max_uploads_per_principal: int = MAX_UPLOADS_PER_PRINCIPAL

    def __post_init__(self) -> None:
        for name in ("idle_timeout", "head_timeout", "body_grace", "body_window", "upload_idle"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if (self.min_body_rate < 0 or self.max_connections < 1 or self.max_per_peer < 1 or self.reserved < 0
                or self.max_uploads < 1 or self.max_uploads_per_principal < 1):
            raise ValueError("rates, connection and upload counts must be positive (reserved: zero or more)")
