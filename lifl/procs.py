"""Process lifetime helpers shared by the node's processes."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: safe to call between fork and exec


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
