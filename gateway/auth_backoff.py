"""Back-off for failed authentication, per client address: pure logic (the caller says what time
it is), no I/O.

An address that fails to authenticate (no credentials, a malformed ``Authorization``, a token
that is unknown, expired or revoked, a certificate that names nobody) more than
MAX_AUTH_FAILURES times within AUTH_FAILURE_WINDOW_S backs off for the rest of that window:
its further failures are answered 429 ``too_many_auth_failures`` with Retry-After (gRPC
RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms``) instead of 401, and over HTTP/1.1 its
connection is closed, so that each further guess costs a connection. Only failures are counted:
a valid credential is checked as before (from the token cache) and served whatever its address
did, so callers sharing an address with a guesser (behind one NAT) are never slowed.

The state is bounded: at most MAX_TRACKED_ADDRESSES addresses, the one whose window started
first forgotten to make room (it is the closest to ending anyway).
"""

from __future__ import annotations

from lifl.errors import LiflError

MAX_AUTH_FAILURES = 100  # failed authentications one address may have within a window...
AUTH_FAILURE_WINDOW_S = 60.0  # ...which starts at its first failure; past them, 429 until it ends
MAX_TRACKED_ADDRESSES = 10_000  # addresses whose failures are remembered at once


class TooManyAuthFailures(LiflError):
    """The caller's address failed to authenticate too often lately (HTTP 429, with Retry-After)."""

    status = 429
    grpc_status = "RESOURCE_EXHAUSTED"
    default_code = "too_many_auth_failures"


class _Window:
    __slots__ = ("start", "failures")

    def __init__(self, start: float) -> None:
        self.start, self.failures = start, 0


class AuthBackoff:
    """Failed authentications per address, in fixed windows (one entry per address: cheap, and
    only failures ever reach it)."""

    def __init__(self, max_failures: int = MAX_AUTH_FAILURES, window_s: float = AUTH_FAILURE_WINDOW_S,
                 max_addresses: int = MAX_TRACKED_ADDRESSES) -> None:
        if max_failures < 1 or max_addresses < 1 or not window_s > 0:
            raise ValueError("max_failures, window_s and max_addresses must be positive")
        self.max_failures, self.window_s, self.max_addresses = max_failures, window_s, max_addresses
        self._windows: dict[str, _Window] = {}  # by address, in the order their windows started

    def __len__(self) -> int:
        return len(self._windows)

    def failed(self, address: str, now: float) -> TooManyAuthFailures | None:
        """Count a failed authentication from ``address`` at ``now`` (seconds, monotonic): None
        while the address is within its limit, else what to answer instead of the failure."""
        window = self._windows.get(address)
        if window is None or now - window.start >= self.window_s:
            if window is not None:
                del self._windows[address]  # re-inserted below: the dictionary stays in start order
            elif len(self._windows) >= self.max_addresses:
                del self._windows[next(iter(self._windows))]
            window = self._windows[address] = _Window(now)
        window.failures += 1
        if window.failures <= self.max_failures:
            return None
        return TooManyAuthFailures(f"more than {self.max_failures} failed authentications from this address within "
                                   f"{self.window_s:g} s: retry once the window ends (Retry-After); valid credentials "
                                   "are served meanwhile", retry_after=window.start + self.window_s - now)
