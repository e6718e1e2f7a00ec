"""Models to and from the update format (``lifl.format``): torch ``state_dict``s (any device,
bfloat16 included) and dicts of numpy arrays, read in place and returned as views of the blob."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lifl import format as fmt


def to_blob(state: Mapping[str, Any], metadata: Mapping[str, str] | None = None,
            dtypes: Mapping[str, str] | None = None) -> bytearray:
    """A torch ``state_dict`` (any device, bf16 included) or a dict of numpy arrays, as an update
    blob; ``dtypes`` marks uint16 numpy arrays that hold bfloat16 bits ({name: "BF16"})."""
    arrays: dict[str, np.ndarray] = {}
    dtypes = dict(dtypes or {})
    for name, value in state.items():
        if hasattr(value, "detach"):  # a torch tensor: read it in place when it is on the CPU
            import torch

            t = value.detach()
            t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
            if t.dtype == torch.bfloat16:
                arrays[name], dtypes[name] = t.view(torch.int16).numpy().view(np.uint16), "BF16"
            else:
                arrays[name] = t.numpy()
        else:
            arrays[name] = np.asarray(value)
    return fmt.encode(arrays, metadata, dtypes=dtypes)


def from_blob(blob: bytes | bytearray | memoryview, *, as_torch: bool = False) -> dict[str, Any]:
    """The tensors of a blob, as numpy arrays (BF16 as uint16) or torch tensors, viewing the blob's
    bytes (a read-only blob is copied once so that torch may use it)."""
    layout = fmt.parse_layout(blob)
    fmt.check_finite(blob, layout)  # in numpy: the SDK installs without the C kernels
    if not as_torch:
        return fmt.views(blob, layout)
    import torch

    buffer = blob if isinstance(blob, bytearray) else bytearray(blob)
    views = fmt.views(buffer, layout)
    out = {}
    for entry in layout.entries:
        view = views[entry.spec.name]
        if entry.spec.dtype is fmt.BF16:
            out[entry.spec.name] = torch.from_numpy(view.view(np.int16)).view(torch.bfloat16)
        else:
            out[entry.spec.name] = torch.from_numpy(view)
    return out
