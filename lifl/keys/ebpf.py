"""Loader of the eBPF key channel (``bpf/keychan.bpf.o``): pins, attaches, fills its maps.

The object holds an SK_MSG verdict on ``instances``, a sockhash of the node's aggregator TCP
sockets keyed by instance id: each send() of one 64-byte key message is redirected into the
destination socket's receive queue, or, if it has no route or crosses tenants, passed to the
sender's real TCP peer (the node's fallback listener). See the program's header comment.

Two tools, each where it is the simplest robust choice:

- ``bpftool`` (subprocess) loads the object, pins the program and maps, attaches and detaches
  the verdict: libbpf inside it parses the ELF, applies CO-RE relocations and creates the
  maps from their BTF, which a hand-written ctypes loader would have to redo (or bind all of
  libbpf's object API for). These happen once per node, so a process spawn costs nothing.
- the bpf(2) syscall through ctypes for everything per socket or per read: a sockhash (and
  socket storage) update takes a socket *fd* of the calling process, which bpftool, a
  separate process, cannot be given. Five commands with fixed attribute layouts, no library.

A registered socket is both an instance's receiver (messages to its id land in its receive
queue) and its sender (its sends go through the verdict). Its tenant is stored on the socket
(socket storage, ``senders``), so the verdict checks a record's tenant field against the
sender's real tenant and the destination's (``tenants``) rather than trusting it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from lifl.keys.record import AGENT_ID, KIND_ACK, MESSAGE_BYTES, KeyMessage, stamped
from lifl.net.io import ready
from lifl.store import Tenant

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"  # in a source checkout (make builds it)
# An installed lifl (the node image) has no source checkout: LIFL_BPF_OBJECT names the object.
OBJECT = Path(os.environ.get("LIFL_BPF_OBJECT") or BPF_DIR / "keychan.bpf.o")
BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "lifl"  # a node's channel is pinned under PIN_ROOT / <node>

# Mirrors of bpf/keychan.bpf.c, checked against the loaded maps when KeyMaps opens them.
MAX_INSTANCES = 4096  # sockets (instances) one node's channel holds
MAX_OUTSTANDING = 256  # messages redirected to one instance and not acknowledged (then they go the TCP way)
MAX_ID = (1 << 32) - 1  # instance and tenant ids are __u32 in the record and the maps
PASS_REASONS = ("not_a_record", "unknown_sender", "tenant", "no_route", "full", "ack")  # enum pass_reason
_DEST_STATS = struct.Struct("<QQQ")  # struct dest_stats: messages, bytes, agg_us
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

PROGRAM_PIN = "prog"  # pin_dir/prog: the verdict
MAPS_PIN = "maps"  # pin_dir/maps/<map name>
MAP_NAMES = ("instances", "tenants", "senders", "outstanding", "stats", "passed")
_SENDER = struct.Struct("<II")  # struct sender: tenant, instance

BPFTOOL_TIMEOUT_S = 30.0  # one bpftool call (loading verifies the program: well under a second)


class EbpfError(RuntimeError):
    """A bpftool step or a bpf(2) call failed; the message says which and why."""


# --- bpf(2) -------------------------------------------------------------------------------

_SYS_BPF = {"x86_64": 321, "aarch64": 280}  # the syscall's number per architecture
_BPF_MAP_LOOKUP_ELEM = 1
_BPF_MAP_UPDATE_ELEM = 2
_BPF_MAP_DELETE_ELEM = 3
_BPF_MAP_GET_NEXT_KEY = 4
_BPF_OBJ_GET = 7
_BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_PROG_QUERY = 16
_BPF_SK_MSG_VERDICT = 7  # enum bpf_attach_type
_BPF_ANY = 0
_ATTR_BYTES = 64  # larger than every layout used here; the kernel wants the tail zeroed
_MAP_INFO_BYTES = 88  # of struct bpf_map_info, the kernel fills what fits
_MAX_QUERY_PROGS = 64  # program ids one BPF_PROG_QUERY returns

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(command: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    """bpf(command, attr) on an attribute buffer the kernel may write back into."""
    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise EbpfError(f"the eBPF key channel does not support {platform.machine()}")
    result = _libc.syscall(ctypes.c_long(number), ctypes.c_long(command), attr, ctypes.c_long(_ATTR_BYTES))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def _bpf(command: int, attr_fields: bytes) -> int:
    """bpf(command, attr): the result, or OSError with the errno."""
    return _syscall(command, ctypes.create_string_buffer(attr_fields.ljust(_ATTR_BYTES, b"\0"), _ATTR_BYTES))


def _address(buffer: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(buffer)


def _obj_get(path: Path) -> int:
    """An fd of a pinned object (BPF_OBJ_GET: pathname, bpf_fd, file_flags)."""
    name = ctypes.create_string_buffer(os.fsencode(path))  # referenced until the call returns
    try:
        return _bpf(_BPF_OBJ_GET, struct.pack("<QII", _address(name), 0, 0))
    except OSError as error:
        raise EbpfError(f"opening pinned {path}: {error.strerror}") from error


def _elem_attr(map_fd: int, key: ctypes.Array[ctypes.c_char], value: int, flags: int = 0) -> bytes:
    """map_fd, (pad), key, value or next_key, flags. The attribute holds raw addresses: the
    caller keeps ``key`` (and the value's buffer) referenced until the syscall returns."""
    return struct.pack("<IIQQQ", map_fd, 0, _address(key), value, flags)


def _update(map_fd: int, key: bytes, value: bytes) -> None:
    key_buffer, value_buffer = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    _bpf(_BPF_MAP_UPDATE_ELEM, _elem_attr(map_fd, key_buffer, _address(value_buffer), _BPF_ANY))


def _delete(map_fd: int, key: bytes) -> bool:
    """True if the key was there."""
    key_buffer = ctypes.create_string_buffer(key, len(key))
    try:
        _bpf(_BPF_MAP_DELETE_ELEM, _elem_attr(map_fd, key_buffer, 0))
    except OSError as error:
        if error.errno == errno.ENOENT:
            return False
        raise
    return True


def _lookup(map_fd: int, key: bytes, value_bytes: int) -> bytes | None:
    key_buffer, value = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_bytes)
    try:
        _bpf(_BPF_MAP_LOOKUP_ELEM, _elem_attr(map_fd, key_buffer, _address(value)))
    except OSError as error:
        if error.errno == errno.ENOENT:
            return None
        raise
    return value.raw


def _keys(map_fd: int, key_bytes: int) -> list[bytes]:
    """Every key (BPF_MAP_GET_NEXT_KEY from none); a snapshot, keys may come and go meanwhile."""
    keys: list[bytes] = []
    current = ctypes.create_string_buffer(key_bytes)
    next_key = ctypes.create_string_buffer(key_bytes)
    key_address = 0  # NULL: the first key
    while True:
        try:
            _bpf(_BPF_MAP_GET_NEXT_KEY, struct.pack("<IIQQQ", map_fd, 0, key_address, _address(next_key), 0))
        except OSError as error:
            if error.errno == errno.ENOENT:
                return keys
            raise
        keys.append(next_key.raw)
        ctypes.memmove(current, next_key, key_bytes)
        key_address = _address(current)


def _map_shape(map_fd: int) -> tuple[int, int, int]:
    """(key size, value size, max entries) of a map: struct bpf_map_info's third to fifth
    fields (BPF_OBJ_GET_INFO_BY_FD: bpf_fd, info_len, info)."""
    info = ctypes.create_string_buffer(_MAP_INFO_BYTES)
    _bpf(_BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", map_fd, _MAP_INFO_BYTES, _address(info)))
    key_size, value_size, max_entries = struct.unpack_from("<III", info.raw, 8)
    return key_size, value_size, max_entries


def _attached_programs(map_fd: int) -> list[int]:
    """Ids of the SK_MSG verdicts attached to a sockhash (BPF_PROG_QUERY, kernel 5.19+):
    target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt."""
    ids = (ctypes.c_uint32 * _MAX_QUERY_PROGS)()
    fields = struct.pack("<IIIIQI", map_fd, _BPF_SK_MSG_VERDICT, 0, 0, ctypes.addressof(ids), _MAX_QUERY_PROGS)
    attr = ctypes.create_string_buffer(fields.ljust(_ATTR_BYTES, b"\0"), _ATTR_BYTES)
    _syscall(_BPF_PROG_QUERY, attr)  # the kernel writes prog_cnt back
    (count,) = struct.unpack_from("<I", attr.raw, 24)
    return list(ids[:count])


def _possible_cpus() -> int:
    """Per-CPU maps hold one value per *possible* CPU ("0-3" or "0,2-5")."""
    count = 0
    for part in Path("/sys/devices/system/cpu/possible").read_text().strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


# --- bpftool ------------------------------------------------------------------------------

def _bpftool(*args: str) -> str:
    exe = shutil.which("bpftool")
    if exe is None:
        raise EbpfError("bpftool is not installed (make install installs it)")
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=BPFTOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise EbpfError(f"bpftool {' '.join(args)}: no answer in {BPFTOOL_TIMEOUT_S:.0f} s") from error
    if done.returncode != 0:
        raise EbpfError(f"bpftool {' '.join(args)} failed:\n{done.stderr.strip()}")
    return done.stdout


def build() -> Path:
    """Build the object if its sources changed (make's timestamps; a no-op otherwise)."""
    try:
        subprocess.run(["make", "-s", "-C", str(BPF_DIR)], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise EbpfError(f"building {OBJECT} failed:\n{error.stdout}{error.stderr}") from error
    return OBJECT


def ensure_bpffs() -> None:
    """Pins need a bpf file system on /sys/fs/bpf; mount it when the system has not."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    if any(line.split()[1:3] == [str(BPFFS), "bpf"] for line in mounts):
        return
    try:
        subprocess.run(["mount", "-t", "bpf", "bpf", str(BPFFS)], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise EbpfError(f"mounting the bpf file system on {BPFFS} failed: {error.stderr.strip()}") from error


# --- the channel's maps -------------------------------------------------------------------

class DestStats(NamedTuple):
    messages: int
    bytes: int
    agg_us: int  # sum of the aggregation times the senders reported


class KeyMaps:
    """The pinned maps of one loaded channel, opened by this process."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = pin_dir
        self._fds: dict[str, int] = {}
        try:
            for name in MAP_NAMES:
                self._fds[name] = _obj_get(pin_dir / MAPS_PIN / name)
            self._check_mirrors()
        except BaseException:
            self._close_fds()
            raise
        self._cpus = _possible_cpus()

    def _check_mirrors(self) -> None:
        """Fail loudly if bpf/keychan.bpf.c and this module's mirrors of it drifted apart."""
        expected = {  # name: (key size, value size, max entries); senders has no max (per socket)
            "instances": (4, 8, MAX_INSTANCES), "tenants": (4, 4, MAX_INSTANCES), "senders": (4, _SENDER.size, 0),
            "outstanding": (4, 8, MAX_INSTANCES),
            "stats": (4, _DEST_STATS.size, MAX_INSTANCES), "passed": (4, 8, len(PASS_REASONS)),
        }
        for name, shape in expected.items():
            actual = _map_shape(self._fds[name])
            if actual != shape:
                raise EbpfError(f"map {name} is (key, value, entries) {actual}, lifl/keys/ebpf.py expects {shape}: "
                                "rebuild bpf/ and update the mirrors")

    @staticmethod
    def _check_id(what: str, value: int) -> None:
        if not 0 <= value <= MAX_ID:
            raise ValueError(f"{what} {value} is not a 32-bit id (0..{MAX_ID})")

    def register(self, instance_id: int, tenant_id: int, sock: socket.socket) -> None:
        """Route ``instance_id`` to ``sock`` (an established TCP socket of this process), whose
        sends speak for ``tenant_id``. Registering an id again moves its route to the new
        socket; the old socket leaves the sockhash (messages it had not read are discarded).
        A socket stands for one instance: the kernel refuses it a second entry (EBUSY)."""
        self._check_id("instance id", instance_id)
        self._check_id("tenant id", tenant_id)
        key, tenant, fd = _U32.pack(instance_id), _U32.pack(tenant_id), sock.fileno()
        try:
            # the sender's tenant first, then the destination's, then the route: the verdict
            # never sees a route whose tenant it cannot check
            _update(self._fds["senders"], _U32.pack(fd), _SENDER.pack(tenant_id, instance_id))
            _update(self._fds["outstanding"], key, _U64.pack(0))  # a new socket's queue is empty
            _update(self._fds["tenants"], key, tenant)
            _update(self._fds["instances"], key, _U64.pack(fd))
        except OSError as error:
            hint = {
                errno.EOPNOTSUPP: " (the socket must be an established TCP socket)",
                errno.EBUSY: " (the socket is registered for another instance already)",
                errno.E2BIG: f" (at most {MAX_INSTANCES} instances)",
            }.get(error.errno, "")
            raise EbpfError(f"registering instance {instance_id}: {error.strerror}{hint}") from error

    def unregister(self, instance_id: int) -> DestStats | None:
        """Remove the instance's route and tenant; returns its final counts (None if it never
        received a message). Messages its socket had not read are discarded with the route."""
        self._check_id("instance id", instance_id)
        key = _U32.pack(instance_id)
        _delete(self._fds["instances"], key)  # may already be gone: a closed socket leaves by itself
        _delete(self._fds["tenants"], key)
        _delete(self._fds["outstanding"], key)
        final = self._dest_stats(key)
        _delete(self._fds["stats"], key)
        return final

    def outstanding(self, instance_id: int) -> int:
        """Messages redirected to the instance that it has not acknowledged."""
        value = _lookup(self._fds["outstanding"], _U32.pack(instance_id), _U64.size)
        return _U64.unpack(value)[0] if value is not None else 0

    def routes(self) -> dict[int, int]:
        """instance id -> tenant id of every registered instance."""
        fd = self._fds["tenants"]
        routes: dict[int, int] = {}
        for key in _keys(fd, _U32.size):
            value = _lookup(fd, key, _U32.size)
            if value is not None:
                routes[_U32.unpack(key)[0]] = _U32.unpack(value)[0]
        return routes

    def _per_cpu(self, map_name: str, key: bytes, value_bytes: int) -> list[bytes]:
        stride = (value_bytes + 7) // 8 * 8  # per-CPU values are 8-byte aligned
        raw = _lookup(self._fds[map_name], key, stride * self._cpus)
        if raw is None:
            return []
        return [raw[cpu * stride: cpu * stride + value_bytes] for cpu in range(self._cpus)]

    def _dest_stats(self, key: bytes) -> DestStats | None:
        per_cpu = [_DEST_STATS.unpack(value) for value in self._per_cpu("stats", key, _DEST_STATS.size)]
        return DestStats(*(sum(column) for column in zip(*per_cpu))) if per_cpu else None

    def stats(self) -> dict[int, DestStats]:
        """Messages redirected to each destination, summed over CPUs."""
        totals: dict[int, DestStats] = {}
        for key in _keys(self._fds["stats"], _U32.size):
            counts = self._dest_stats(key)
            if counts is not None:  # None: unregistered meanwhile
                totals[_U32.unpack(key)[0]] = counts
        return totals

    def passed(self) -> dict[str, int]:
        """Messages the verdict passed to TCP (not redirected), by reason."""
        return {reason: sum(_U64.unpack(value)[0] for value in self._per_cpu("passed", _U32.pack(index), _U64.size))
                for index, reason in enumerate(PASS_REASONS)}

    def attached_programs(self) -> list[int]:
        """Ids of the verdicts attached to the sockhash (ours: one)."""
        return _attached_programs(self._fds["instances"])

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        """Unload the channel: every route removed, the verdict detached, everything unpinned."""
        self._close_fds()
        unload(self.pin_dir)


def program_id(pin_dir: Path) -> int:
    """The kernel's id of the loaded verdict (to find it in ``bpftool prog show``)."""
    return int(json.loads(_bpftool("prog", "show", "pinned", str(pin_dir / PROGRAM_PIN), "--json"))["id"])


def load(pin_dir: Path, obj: Path = OBJECT) -> KeyMaps:
    """Load the channel and pin it under ``pin_dir`` (a node's: ``PIN_ROOT / <node>``), after
    removing what a crashed run left there, and attach the verdict to the sockhash."""
    ensure_bpffs()
    cleanup_stale(pin_dir)
    pin_dir.mkdir(parents=True)
    try:
        _bpftool("prog", "load", str(obj), str(pin_dir / PROGRAM_PIN), "type", "sk_msg",
                 "pinmaps", str(pin_dir / MAPS_PIN))
        _bpftool("prog", "attach", "pinned", str(pin_dir / PROGRAM_PIN), "msg_verdict",
                 "pinned", str(pin_dir / MAPS_PIN / "instances"))
        return KeyMaps(pin_dir)
    except BaseException:
        unload(pin_dir)
        raise


def unload(pin_dir: Path) -> None:
    """Remove every route (so no socket runs the verdict any longer), detach the verdict from
    the sockhash, unpin program and maps, remove ``pin_dir``. Whatever of this is missing is
    skipped: it also clears what a crashed run left."""
    program, instances = pin_dir / PROGRAM_PIN, pin_dir / MAPS_PIN / "instances"
    if instances.exists():
        fd = _obj_get(instances)
        try:
            for key in _keys(fd, _U32.size):
                _delete(fd, key)
            attached = _attached_programs(fd)  # none after a crash between load and attach
        finally:
            os.close(fd)
        if attached and program.exists():
            _bpftool("prog", "detach", "pinned", str(program), "msg_verdict", "pinned", str(instances))
    if pin_dir.exists():
        for pin in sorted(pin_dir.rglob("*"), key=lambda path: len(path.parts), reverse=True):  # deepest first
            if pin.is_dir():
                pin.rmdir()
            else:
                pin.unlink()  # unpinning is unlinking
        pin_dir.rmdir()


def cleanup_stale(pin_dir: Path) -> bool:
    """Unload what a crashed run left pinned at ``pin_dir``; True if there was anything."""
    if not pin_dir.exists():
        return False
    unload(pin_dir)
    return True


def remove_node_channel(node: str) -> bool:
    """Unload what node ``node``'s agent left pinned if it was killed; True if there was anything."""
    return cleanup_stale(PIN_ROOT / node)


def wait_unloaded(program: int, timeout_s: float) -> bool:
    """Whether the kernel freed program ``program`` within ``timeout_s``. Unload drops the last
    reference, but a socket that left the sockhash releases its copy in an RCU callback, so
    the program may outlive ``unload`` by a grace period."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = {entry["id"] for entry in json.loads(_bpftool("prog", "show", "--json"))}
        if program not in ids:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling a condition with a deadline, not a sleep as synchronisation


# --- the transport (lifl.keys.transport.KeyTransport) ------------------------------------

AGENT_SENDER_BASE = 1 << 31  # the agent's sending sockets' ids: instance ids stay below
CAP_NET_ADMIN, CAP_BPF = 12, 39  # capability numbers (linux/capability.h)
MAX_FALLBACK_LOGGED = 16  # refused messages described in the log (then only counted)
ACK_EVERY = 64  # a receiver gives back its credits this often (and before it waits for more)
MAX_PARKED = 1024  # messages the agent holds for one instance over its credits; then it stops reading their senders
_KIND = struct.Struct("<H")  # a record's kind, at offset 8
_KIND_OFFSET = 8


class EbpfEndpoint:
    """An instance's (or the agent's) registered TCP socket: a send is one 64-byte record, which
    the verdict redirects; what arrives is a byte stream framed here, 64 bytes a record. Reads
    take at most the rest of the current record, so nothing waits in a buffer of ours while
    poll() says the socket is idle."""

    def __init__(self, sock: socket.socket, tenant: int) -> None:
        self._sock = sock
        self.tenant = tenant
        self._partial = bytearray()
        self._unacked = 0  # messages read and not yet acknowledged (credits the senders wait for)
        self._send_lock = threading.Lock()  # one record per send(), never interleaved

    def send(self, message: KeyMessage) -> None:
        self.send_record(stamped(message, self.tenant))

    def send_record(self, record: bytes) -> None:
        with self._send_lock:
            self._sock.sendall(record)

    def try_send(self, message: KeyMessage) -> bool:
        record = stamped(message, self.tenant)
        with self._send_lock:
            try:
                sent = self._sock.send(record, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            if sent < len(record):  # one verdict per send(): the rest must follow at once
                self._sock.sendall(record[sent:])
        return True

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        """The next message. Credits go back every ACK_EVERY messages read, and before waiting
        for one; not when a poll (``timeout=0``) finds nothing, so that draining a queue right
        after a wake-up costs no message to the agent (a receiver keeps at most ACK_EVERY - 1
        credits, so senders always have more left than it holds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._partial) < MESSAGE_BYTES:
            try:
                chunk = self._sock.recv(MESSAGE_BYTES - len(self._partial), socket.MSG_DONTWAIT)
            except BlockingIOError:
                if timeout == 0:
                    return None
                self._acknowledge()
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not ready([self._sock], wait):
                    return None
                continue
            if not chunk:
                raise ConnectionError("the key channel's socket was closed")
            self._partial += chunk
        record, self._partial = bytes(self._partial), bytearray()
        self._unacked += 1
        if self._unacked >= ACK_EVERY:
            self._acknowledge()
        return KeyMessage.unpack(record)

    def _acknowledge(self) -> None:
        if self._unacked:
            self.send(KeyMessage(dest=AGENT_ID, task=0, kind=KIND_ACK, count=self._unacked))
            self._unacked = 0

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


class EbpfTransport:
    """Instances' endpoints are TCP connections to a fallback listener of the agent's, each
    registered in the node's sockhash under its instance id: what the verdict redirects never
    crosses TCP; what it passes (no route, another tenant) arrives at the agent's end of the
    sender's connection, where it is counted and logged (keys go between a node's own
    aggregators only; a key for an instance that has gone is not needed by anyone)."""

    name = "ebpf"

    def __init__(self, node: str, directory: Path) -> None:
        del directory  # nothing on the filesystem but the pins
        self.pin_dir = PIN_ROOT / node
        self.keymaps = load(self.pin_dir)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}  # the agent's ends, by registered id
        self._senders: dict[str, EbpfEndpoint] = {}
        self._selector = selectors.DefaultSelector()
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._selector.register(self._wakeup_r, selectors.EVENT_READ)
        self.refused = 0  # messages nobody took (no such instance, or another tenant's)
        self._instances: dict[int, Tenant] = {}  # provisioned, not retired
        self._inbound: dict[int, bytearray] = {}  # part of a record read from a peer
        self._parked: dict[int, deque[bytes]] = {}  # records held for a destination over its credits
        self._blocked: dict[int, set[int]] = {}  # peers not read while a destination's hold is full
        self._retired = DestStats(0, 0, 0)  # counts of instances gone
        self._closed = False
        threading.Thread(target=self._fallback, name="ebpf-fallback", daemon=True).start()

    def _connect(self, registered_id: int, tenant: int) -> socket.socket:
        with self._lock:
            ours = socket.create_connection(self._listener.getsockname()[:2])
            theirs, _ = self._listener.accept()
        ours.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.keymaps.register(registered_id, tenant, ours)
        with self._lock:
            self._peers[registered_id] = theirs
        self._selector.register(theirs, selectors.EVENT_READ, registered_id)
        self._wakeup_w.send(b"x")
        return ours

    def provision(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        if not 0 < instance < AGENT_SENDER_BASE:
            raise ValueError(f"instance id {instance} is outside 1..{AGENT_SENDER_BASE - 1}")
        sock = self._connect(instance, tenant.id)
        self._instances[instance] = tenant
        return sock, f"{self.name}:{tenant.id}"

    def retire(self, tenant: Tenant, instance: int) -> None:
        self._instances.pop(instance, None)
        final = self.keymaps.unregister(instance)
        if final is not None:  # its counts leave the map with it: kept here, so totals never go down
            with self._lock:
                self._retired = DestStats(*(a + b for a, b in zip(self._retired, final)))
        self._forget(instance)

    def totals(self) -> DestStats:
        """Messages, bytes and reported aggregation µs the verdict redirected, since start."""
        live = list(self.keymaps.stats().values())
        with self._lock:
            return DestStats(*(sum(column) for column in zip(self._retired, *live)))

    def collector(self) -> Collector:
        return _ChannelCollector(self)

    def _forget(self, registered_id: int) -> None:
        with self._lock:
            peer = self._peers.pop(registered_id, None)
        if peer is not None:
            with contextlib.suppress(KeyError):  # not read while its destination's hold is full
                self._selector.unregister(peer)
            peer.close()
        self._inbound.pop(registered_id, None)

    def sender(self, tenant: Tenant) -> EbpfEndpoint:
        with self._lock:
            endpoint = self._senders.get(tenant.name)
            index = len(self._senders)
        if endpoint is None:
            endpoint = EbpfEndpoint(self._connect(AGENT_SENDER_BASE + index, tenant.id), tenant.id)
            with self._lock:
                endpoint = self._senders.setdefault(tenant.name, endpoint)
        return endpoint

    def _fallback(self) -> None:
        """Read what the verdict passed to TCP, a record at a time, on one thread."""
        while not self._closed:
            for key, _ in self._selector.select():
                if key.fileobj is self._wakeup_r:
                    self._wakeup_r.recv(4096)
                    continue
                peer: int = key.data
                try:
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    self._forget(peer)
                    continue
                buffer = self._inbound.setdefault(peer, bytearray())
                buffer += data
                whole = len(buffer) // MESSAGE_BYTES * MESSAGE_BYTES
                records = bytes(buffer[:whole])
                del buffer[:whole]
                for offset in range(0, whole, MESSAGE_BYTES):
                    self._passed(peer, records[offset : offset + MESSAGE_BYTES])

    def _passed(self, peer: int, record: bytes) -> None:
        """An acknowledgement gives the sender's credits back: what is held for it goes now. A
        message over its destination's credits is held (at most MAX_PARKED per destination;
        past that its sender is no longer read, and TCP stops it). A message no instance of its
        tenant takes is counted, and the first few logged."""
        if _KIND.unpack_from(record, _KIND_OFFSET)[0] == KIND_ACK:
            self._release(peer)
            return
        message = KeyMessage.unpack(record)
        tenant = self._instances.get(message.dest)
        if tenant is None or tenant.id != message.tenant:
            self._refused(peer, message.dest)
            return
        parked = self._parked.setdefault(message.dest, deque())
        parked.append(record)  # (what one read brought is held whole: MAX_PARKED plus a read at most)
        blocked = self._blocked.setdefault(message.dest, set())
        if len(parked) >= MAX_PARKED and peer in self._peers and peer not in blocked:
            self._selector.unregister(self._peers[peer])
            blocked.add(peer)
        self._release(message.dest)  # its credits may be back already

    def _release(self, dest: int) -> None:
        """Send what is held for ``dest`` while it has credits; read its blocked senders again."""
        parked = self._parked.get(dest)
        if not parked:
            return
        tenant = self._instances.get(dest)
        if tenant is None:  # it went: what was held for it has no taker
            for _ in range(len(parked)):
                self._refused(AGENT_ID, dest)
            parked.clear()
        else:
            sender = self.sender(tenant)
            while parked and self.keymaps.outstanding(dest) < MAX_OUTSTANDING:
                sender.send_record(parked.popleft())
        if len(parked) < MAX_PARKED:
            for peer in self._blocked.pop(dest, set()):
                if peer in self._peers:
                    self._selector.register(self._peers[peer], selectors.EVENT_READ, peer)

    def _refused(self, sender: int, dest: int) -> None:
        self.refused += 1
        if self.refused <= MAX_FALLBACK_LOGGED:
            print(f"lifl agent: a key message from endpoint {sender} to {dest} was not delivered "
                  f"(no such instance, or another tenant's)", file=sys.stderr)

    def close(self) -> None:
        self._closed = True
        self._wakeup_w.send(b"x")
        for endpoint in self._senders.values():
            endpoint.close()
        for registered_id in list(self._peers):
            self._forget(registered_id)
        self._listener.close()
        self.keymaps.close()


class _ChannelCollector(Collector):
    """The channel's in-kernel counts, read from the maps when Prometheus scrapes: nothing polls."""

    def __init__(self, transport: EbpfTransport) -> None:
        self.transport = transport

    def collect(self) -> Iterator[Metric]:
        totals = self.transport.totals()
        yield CounterMetricFamily("lifl_channel_messages", "Key messages redirected in the kernel (eBPF)", value=totals.messages)
        yield CounterMetricFamily("lifl_channel_bytes", "Bytes of key messages redirected in the kernel", value=totals.bytes)
        yield CounterMetricFamily("lifl_channel_reported_aggregation_seconds",
                                  "Aggregation time the senders of redirected messages reported", value=totals.agg_us / 1e6)
        passed = CounterMetricFamily("lifl_channel_passed", "Key messages not redirected (sent the TCP way), by reason",
                                     labels=["reason"])
        for reason, count in self.transport.keymaps.passed().items():
            passed.add_metric([reason], count)
        yield passed


def available() -> str | None:
    """Why the eBPF transport cannot run here, or None if it can."""
    if not OBJECT.exists():
        return f"{OBJECT} is not built (make bpf)"
    if shutil.which("bpftool") is None:
        return "bpftool is not installed"
    if os.geteuid() != 0 and not _has_capabilities(CAP_BPF, CAP_NET_ADMIN):
        return "it needs CAP_BPF and CAP_NET_ADMIN (or root)"
    return None



def _has_capabilities(*capabilities: int) -> bool:
    """Whether this process's effective set holds every one of ``capabilities``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return all(effective >> c & 1 for c in capabilities)
    return False
