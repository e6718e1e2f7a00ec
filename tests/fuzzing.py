"""What the fuzz suites share: mutations of valid inputs (hypothesis strategies)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, base: bytes, interesting: Sequence[bytes]) -> bytes:
    """``base`` with a few insertions, deletions and replacements, of ``interesting`` or random bytes."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(("insert", "delete", "replace", "byte")))
        piece = draw(st.sampled_from(interesting) | st.binary(min_size=1, max_size=4))
        if op == "insert":
            data[at:at] = piece
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "replace":
            data[at : at + len(piece)] = piece
        elif data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
    return bytes(data)
