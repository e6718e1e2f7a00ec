"""Run the function image's shim as UID:GID, as a pod would: ``python shim_as.py UID GID``.

The test machine's Python may live where other users cannot read it (a pyenv under /root), so
everything the shim runs is imported while still root, then the process becomes UID:GID for
good before the shim starts: what the agent sees of it (its peer credentials, and its access
to shared memory) is exactly a pod's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent.parent / "templates" / "lifl-aggregator"
sys.path.insert(0, str(SHIM_DIR))

import index  # noqa: E402  (the shim, from its template)
import lifl.keys.ebpf  # noqa: E402,F401  (the eBPF key endpoint's, imported when it attaches)

index.load_handler(Path(os.environ["LIFL_FUNCTION_DIR"]))  # and the handler's imports
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sys.exit(index.main())
