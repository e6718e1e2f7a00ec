"""Checkpoints of global models, so that a restarted node resumes every job where it was.

The agent writes a checkpoint of each new version in the background, from the model's
shared-memory object, and makes the version visible to clients only once it is durable: a
node killed at any moment comes back with the newest version any client could have seen, so
no version is lost and none is produced twice.

Stores (``--checkpoints`` of `lifl up`):
- ``dir:PATH`` (the default, under the node's data directory): one file per version, written
  by the kernel straight from shared memory, fsynced, then renamed into place;
- ``redis`` (the cluster's Redis) or ``redis://...``: one key per version;
- ``s3://BUCKET/PREFIX?endpoint=URL``: any S3-compatible service; credentials come from the
  usual AWS environment variables.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Protocol

from lifl.redisconn import bulk_client

KEEP = 3  # versions kept per job


class CheckpointStore(Protocol):
    def save(self, job: str, version: int, fd: int, size: int) -> None:
        """Store ``size`` bytes read from ``fd`` (a shared-memory object) as ``version``."""

    def load(self, job: str, version: int) -> bytes: ...

    def versions(self, job: str) -> list[int]:
        """Stored versions of ``job``, ascending."""

    def delete(self, job: str, version: int) -> None: ...

    # retained client updates (lifl.flstore.retention), written behind and fetched back on a miss
    def save_blob(self, job: str, name: str, fd: int, size: int) -> None: ...

    def load_blob(self, job: str, name: str) -> bytes: ...

    def delete_blob(self, job: str, name: str) -> None: ...


def part_name(version: int, first: int, stop: int) -> str:
    """The blob of a node's part (shards [first, stop)) of ``version`` of a job whose shards are
    split across nodes (lifl.shards): each node checkpoints its own part; version 0 is whole."""
    return f"part-{first:03d}-{stop:03d}-{version:012d}"


def latest(store: CheckpointStore, job: str) -> int | None:
    versions = store.versions(job)
    return versions[-1] if versions else None


def prune(store: CheckpointStore, job: str, keep: int = KEEP) -> None:
    """Delete all but the newest ``keep`` versions."""
    for version in store.versions(job)[:-keep]:
        store.delete(job, version)


BLOB_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,127}")


def blob_name(name: str) -> str:
    """A retained object's name, checked: it becomes a file name and an object key."""
    if not BLOB_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a retained object's name")
    return name


def _read_all(fd: int, size: int) -> bytes:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n <= 0:
            raise OSError(f"short read of a checkpoint source ({got} of {size} bytes)")
        got += n
    return bytes(data)


class DirectoryStore:
    NAME = re.compile(r"v([0-9]+)\.safetensors")  # fullmatch: "$" would let a final newline through

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, job: str) -> Path:
        return self.root / job

    def save(self, job: str, version: int, fd: int, size: int) -> None:
        self._write(self._dir(job), f"v{version}.safetensors", fd, size)

    @staticmethod
    def _write(directory: Path, name: str, fd: int, size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / name
        tmp = directory / f".{name}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            offset = 0
            while offset < size:  # kernel-side copy out of shared memory (tmpfs to any file system)
                n = os.sendfile(out, fd, offset, size - offset)
                if n <= 0:
                    raise OSError(f"short checkpoint write ({offset} of {size} bytes)")
                offset += n
            os.fsync(out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(out)
        os.replace(tmp, final)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself is durable
        finally:
            os.close(dfd)

    def save_blob(self, job: str, name: str, fd: int, size: int) -> None:
        self._write(self._dir(job) / "retained", f"{blob_name(name)}.safetensors", fd, size)

    def load_blob(self, job: str, name: str) -> bytes:
        return (self._dir(job) / "retained" / f"{blob_name(name)}.safetensors").read_bytes()

    def delete_blob(self, job: str, name: str) -> None:
        (self._dir(job) / "retained" / f"{blob_name(name)}.safetensors").unlink(missing_ok=True)

    def load(self, job: str, version: int) -> bytes:
        return (self._dir(job) / f"v{version}.safetensors").read_bytes()

    def versions(self, job: str) -> list[int]:
        directory = self._dir(job)
        if not directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in directory.iterdir() if (m := self.NAME.fullmatch(p.name)))

    def delete(self, job: str, version: int) -> None:
        (self._dir(job) / f"v{version}.safetensors").unlink(missing_ok=True)


class RedisStore:
    def __init__(self, url: str) -> None:
        self.redis = bulk_client(url)

    @staticmethod
    def _key(job: str, version: int) -> str:
        return f"lifl:ckpt:{job}:{version}"

    def save(self, job: str, version: int, fd: int, size: int) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self._key(job, version), _read_all(fd, size))
        pipe.zadd(f"lifl:ckpt:{job}", {str(version): version})
        pipe.execute()

    def load(self, job: str, version: int) -> bytes:
        data = self.redis.get(self._key(job, version))
        if data is None:
            raise FileNotFoundError(f"no checkpoint of {job} version {version} in Redis")
        return data

    def versions(self, job: str) -> list[int]:
        return [int(v) for v in self.redis.zrange(f"lifl:ckpt:{job}", 0, -1)]

    def delete(self, job: str, version: int) -> None:
        self.redis.delete(self._key(job, version))
        self.redis.zrem(f"lifl:ckpt:{job}", str(version))

    def save_blob(self, job: str, name: str, fd: int, size: int) -> None:
        self.redis.set(f"lifl:ckpt:{job}:blob:{blob_name(name)}", _read_all(fd, size))

    def load_blob(self, job: str, name: str) -> bytes:
        data = self.redis.get(f"lifl:ckpt:{job}:blob:{blob_name(name)}")
        if data is None:
            raise FileNotFoundError(f"no retained object {name} of {job} in Redis")
        return data

    def delete_blob(self, job: str, name: str) -> None:
        self.redis.delete(f"lifl:ckpt:{job}:blob:{blob_name(name)}")


class S3Store:
    NAME = re.compile(r".*/v([0-9]+)\.safetensors", re.DOTALL)  # fullmatch, as above

    def __init__(self, bucket: str, prefix: str, endpoint: str | None) -> None:
        import boto3  # only this store needs it

        self.client = boto3.client("s3", endpoint_url=endpoint)
        self.bucket, self.prefix = bucket, prefix.strip("/")

    def _key(self, job: str, version: int) -> str:
        return "/".join(p for p in (self.prefix, job, f"v{version}.safetensors") if p)

    def save(self, job: str, version: int, fd: int, size: int) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(job, version), Body=_read_all(fd, size))

    def load(self, job: str, version: int) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(job, version))["Body"].read()

    def versions(self, job: str) -> list[int]:
        prefix = "/".join(p for p in (self.prefix, job) if p) + "/"
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                m = self.NAME.fullmatch("/" + obj["Key"])
                if m:
                    out.append(int(m.group(1)))
        return sorted(out)

    def delete(self, job: str, version: int) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(job, version))

    def _blob_key(self, job: str, name: str) -> str:
        return "/".join(p for p in (self.prefix, job, "retained", f"{blob_name(name)}.safetensors") if p)

    def save_blob(self, job: str, name: str, fd: int, size: int) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._blob_key(job, name), Body=_read_all(fd, size))

    def load_blob(self, job: str, name: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._blob_key(job, name))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise FileNotFoundError(f"no retained object {name} of {job} in the bucket") from None

    def delete_blob(self, job: str, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._blob_key(job, name))


def open_store(spec: str, *, data_dir: Path, redis_url: str) -> CheckpointStore:
    """A store from its ``--checkpoints`` spelling."""
    if spec.startswith("dir:"):
        return DirectoryStore(Path(spec[4:]))
    if spec == "redis":
        return RedisStore(redis_url)
    if spec.startswith(("redis://", "unix://")):
        return RedisStore(spec)
    if spec.startswith("s3://"):
        u = urllib.parse.urlsplit(spec)
        endpoint = urllib.parse.parse_qs(u.query).get("endpoint", [None])[0]
        return S3Store(u.netloc, u.path, endpoint)
    if spec == "":
        return DirectoryStore(data_dir / "checkpoints")
    raise ValueError(f"unknown checkpoint store {spec!r}: use dir:PATH, redis, redis://..., or s3://BUCKET/PREFIX?endpoint=URL")
