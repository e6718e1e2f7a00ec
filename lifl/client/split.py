"""Jobs whose shards are split across nodes (docs/sharding.md): each node holds its part of
every update and of every version, so a client sends each node its part of an update, all at
once, and takes the model back from all of them at once.

``SplitJob`` reads where the parts are from any gateway (``Gateway.parts``) and keeps one
connection per node. A part of an update is a blob of its own (``lifl.shards.part_blob``: the
node's pieces of the update's tensors, the canonical bytes of its range), sent with the same
client as the others: the update counts once every part is in. The model is put together from
the parts, which must all be of one version (one that moves meanwhile is read again).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lifl import errors
from lifl import format as fmt
from lifl import shards
from lifl.client.gateway import Gateway, Segment

MODEL_ATTEMPTS = 3  # reads of every part before the model is found to move too fast to be put together


class SplitJob:
    """A split job seen from one client: ``gateway`` is any node's; ``connect`` makes a
    connection to a node's gateway from its HTTP address (as ``gateway``'s, by default)."""

    def __init__(self, gateway: Gateway, job: str, connect: Callable[[str], Gateway] | None = None) -> None:
        self.job = job
        doc = gateway.parts(job)
        self.spec = fmt.ModelSpec.from_json(doc["model"])
        plan = shards.plan(self.spec, *doc["cut"])
        self.parts = [shards.part_of(plan, *p["shards"], node=p["node"]) for p in doc["parts"]]
        addresses = {p["node"]: (p["gateway"] or {}).get("http") for p in doc["parts"]}
        missing = sorted(node for node, address in addresses.items() if not address)
        if missing:
            raise errors.Unavailable(f"node(s) {', '.join(missing)} holding parts of job {job!r} have no gateway",
                                     code="part_unreachable")
        make = connect or (lambda address: Gateway(address, retry=gateway.retry, token=gateway.token, tls=gateway.tls))
        self.gateways = {node: make(address) for node, address in addresses.items()}
        self._pool = ThreadPoolExecutor(len(self.parts), thread_name_prefix=f"lifl-split-{job}")

    def close(self) -> None:
        self._pool.shutdown()
        for gateway in self.gateways.values():
            gateway.close()

    def __enter__(self) -> SplitJob:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def push(self, blob: bytes | memoryview, *, samples: int, base_version: int, client: str | None = None
             ) -> dict[str, Any]:
        """Send each node its part of the update ``blob`` (the model's tensors, in any order), in
        parallel; returns {"version", "parts": each node's answer}. The update counts once every
        part is in; a part refused makes the whole update fail (its error is raised)."""
        pieces = [(part, shards.part_blob(blob, part)) for part in self.parts]
        futures = [self._pool.submit(self.gateways[part.node].push, self.job, piece, samples=samples,
                                     base_version=base_version, client=client) for part, piece in pieces]
        answers = {part.node: future.result() for (part, _), future in zip(pieces, futures)}
        return {"version": base_version, "parts": answers}

    def push_file(self, path: str | os.PathLike[str], *, samples: int, base_version: int, client: str | None = None
                  ) -> dict[str, Any]:
        """``push`` of the update in a safetensors file, each node's part sent from the file
        (``shards.part_ranges``, with sendfile: never read into memory) through a resumable upload
        of its own (``Gateway.push_segments``), all at once; each answer adds its ``sent_bytes``
        and ``resumes``."""
        with open(path, "rb") as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            prefix = os.pread(fd, fmt.PREFIX_BYTES, 0)
            length = fmt.header_length(prefix, size, max_header=self.spec.max_header_bytes)
            layout = fmt.parse_header(os.pread(fd, length, fmt.PREFIX_BYTES), limit=size)
            fmt.check_matches(layout, self.spec)
            if layout.total_size != size:
                raise errors.BadRequest(f"{path} has {size} bytes but its header declares {layout.total_size}",
                                        code="length_mismatch")
            futures = []
            for part in self.parts:
                header = fmt.spec_header(part.spec)
                segments: list[Segment] = [header, *((fd, offset, n) for offset, n in shards.part_ranges(layout, part))]
                futures.append(self._pool.submit(self.gateways[part.node].push_segments, self.job, segments, len(header),
                                                 samples=samples, base_version=base_version, client=client))
            answers = {part.node: future.result() for part, future in zip(self.parts, futures)}
        return {"version": base_version, "parts": answers}

    def model(self) -> tuple[int, bytearray]:
        """(version, blob) of the current model, its parts read from their nodes in parallel and
        put together in the model's canonical layout."""
        header = fmt.spec_header(self.spec)
        for _ in range(MODEL_ATTEMPTS):
            got = list(self._pool.map(lambda part: self.gateways[part.node].part(self.job), self.parts))
            versions = {version for version, _ in got}
            if len(versions) != 1:
                continue  # a version installed between two reads: read them all again
            out = bytearray(len(header) + self.spec.data_bytes)
            out[: len(header)] = header
            for part, (_, blob) in zip(self.parts, got):
                layout = fmt.parse_layout(blob)
                fmt.check_matches(layout, part.spec)
                start = len(header) + part.data_begin
                out[start : start + part.nbytes] = memoryview(blob)[layout.data_start :]
            return versions.pop(), out
        raise errors.Unavailable(f"the model of job {self.job!r} changed during each of {MODEL_ATTEMPTS} reads of its parts",
                                 code="model_moving")
