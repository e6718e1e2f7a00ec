"""Least privilege on a node: who runs as which user, and the modes of what they keep.

`lifl up` as root runs

- the supervisor and the node agent as root. The agent needs it: it creates the shared-memory
  objects (owned by root, group the tenant's, 0600 while written and 0440 once sealed), gives
  each tenant's channel directory to the tenant's group, and starts each tenant's functions
  as the tenant's uid (``lifl.state.TENANT_UID_BASE`` + n, no passwd entries). The supervisor
  starts and restarts the gateway, which needs root to start with (below).
- the gateway as the *service user*: it starts as root, binds its listening sockets (any
  port) and reads its TLS keys, then drops to the service uid and gid, with no supplementary
  groups. From there it reaches the agent's socket (0660, group the service gid), the embedded
  redis's socket (the service user's) and nothing else of the node: shared-memory objects come
  to it as descriptors over the agent's socket, never by name.
- the embedded redis-server as the service user from its start, with umask 077: its directory
  DATA_DIR/redis and its socket's directory RUN_DIR/redis are 0700, its files (AOF, log) 0600.

DATA_DIR is root's, group the service gid, 0710: the service user may pass through to its redis
directory and see nothing else; checkpoints and the operator's token are root's alone (0700
and 0600). Without root everything runs as the invoking user (as before), with the same modes.
Before anything starts as the service user, `lifl up` checks that it can get to every directory
it is given (require_reachable).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifl.state import TENANT_UID_BASE

SERVICE_USER = "lifl"  # the passwd user the gateway and redis run as, if the machine has one
# Otherwise this uid and gid (no passwd entry needed): just below the tenants' ids, so that it is
# never a tenant's, and far above the ids distributions hand out to users and daemons.
SERVICE_FALLBACK_ID = TENANT_UID_BASE - 1
MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to the kernel

DATA_DIR_MODE = 0o710  # root:service: the service user passes through to DATA_DIR/redis, lists nothing
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PRIVATE_UMASK = 0o077  # what the service user's processes create is theirs alone


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int

    def __str__(self) -> str:
        try:
            return f"{pwd.getpwuid(self.uid).pw_name} ({self.uid}:{self.gid})"
        except KeyError:
            return f"{self.uid}:{self.gid}"

    @property
    def spec(self) -> str:
        """The gateway's ``--user`` spelling."""
        return f"{self.uid}:{self.gid}"


def current() -> Identity:
    return Identity(os.geteuid(), os.getegid())


def _named_identity(requested: str) -> Identity:
    """A user name or a numeric uid (whose gid is its passwd entry's, or the same number)."""
    if re.fullmatch(r"[0-9]{1,10}", requested):
        uid = int(requested)
        if uid > MAX_ID:
            raise ValueError(f"--service-user {requested}: a uid is at most {MAX_ID}")
        try:
            return Identity(uid, pwd.getpwuid(uid).pw_gid)
        except KeyError:
            return Identity(uid, uid)
    try:
        entry = pwd.getpwnam(requested)
    except KeyError:
        raise ValueError(f"--service-user {requested!r}: no such user (give a user name or a numeric uid)") from None
    return Identity(entry.pw_uid, entry.pw_gid)


def service_identity(requested: str | None = None) -> Identity:
    """Who the gateway and the embedded redis run as. As root: ``requested`` (a user name or a
    uid; "root" or 0 keeps them root), else the passwd user SERVICE_USER, else SERVICE_FALLBACK_ID.
    Without root: the invoking user, who cannot become anyone else."""
    me = current()
    if me.uid != 0:
        if requested is not None and _named_identity(requested).uid != me.uid:
            raise ValueError(f"--service-user {requested}: running as another user needs root")
        return me
    if requested is not None:
        who = _named_identity(requested)
    else:
        try:
            entry = pwd.getpwnam(SERVICE_USER)
            who = Identity(entry.pw_uid, entry.pw_gid)
        except KeyError:
            who = Identity(SERVICE_FALLBACK_ID, SERVICE_FALLBACK_ID)
    if who.uid >= TENANT_UID_BASE or who.gid >= TENANT_UID_BASE:
        raise ValueError(f"service user {who}: ids from {TENANT_UID_BASE} up are the tenants' (their functions run as them)")
    return who


def parse_user(text: str) -> Identity:
    """``UID:GID``, the gateway's ``--user``."""
    m = re.fullmatch(r"([0-9]{1,10}):([0-9]{1,10})", text)
    if m is None or max(int(m.group(1)), int(m.group(2))) > MAX_ID:
        raise ValueError(f"expected UID:GID, got {text!r}")
    return Identity(int(m.group(1)), int(m.group(2)))


def drop_to(who: Identity) -> None:
    """Become ``who`` for good: real, effective and saved ids, no supplementary groups. The
    kernel clears the parent-death signal on the change: callers that rely on it set it again."""
    os.setgroups([])
    os.setgid(who.gid)
    os.setuid(who.uid)
    if os.getresuid() != (who.uid,) * 3 or os.getresgid() != (who.gid,) * 3 or os.getgroups():
        raise SystemExit(f"could not drop privileges to {who.spec}")
    if who.uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            return
        raise SystemExit(f"dropped to {who.spec} but could become root again")


def popen_as(who: Identity) -> dict[str, Any]:
    """subprocess.Popen arguments that start a process as ``who``, its files private to it."""
    if who == current():
        return {"umask": PRIVATE_UMASK}
    return {"user": who.uid, "group": who.gid, "extra_groups": [], "umask": PRIVATE_UMASK}


def _permits(st: os.stat_result, who: Identity, user_bit: int, group_bit: int, other_bit: int) -> bool:
    """What the mode bits (not ACLs) let ``who``, with no supplementary groups, do."""
    if who.uid == 0:
        return True
    if st.st_uid == who.uid:
        return bool(st.st_mode & user_bit)
    if st.st_gid == who.gid:
        return bool(st.st_mode & group_bit)
    return bool(st.st_mode & other_bit)


def unreachable_by(path: Path, who: Identity) -> Path | None:
    """The first directory on the way to ``path`` that ``who`` may not pass through (None: none)."""
    for directory in reversed([*path.parents]):
        if not _permits(os.stat(directory), who, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return directory
    return None


def can_connect(socket_path: Path, who: Identity) -> bool:
    """Whether ``who`` may connect to a unix socket: pass through its directories, write to it."""
    if unreachable_by(socket_path, who) is not None:
        return False
    try:
        st = os.stat(socket_path)
    except FileNotFoundError:
        return False
    return _permits(st, who, stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH)


def require_reachable(who: Identity, directories: Mapping[Path, str]) -> None:
    """Refuse to hand the service user ``who`` directories it cannot get to: ``directories`` maps
    each to what it is for ("redis-server's directory"). Whoever makes a directory makes it
    ``who``'s or open to it; what is checked here is the way there, every directory above it.
    Called before anything starts as ``who``, so that the refusal names the directory in the way
    where redis-server would stop with a bare "Permission denied" (e.g. at a /var/lib/lifl that
    something else left 0700)."""
    if who == current():
        return  # we just made these directories as ourselves, so we pass through what is above them
    for directory, purpose in directories.items():
        blocked = unreachable_by(directory, who)
        if blocked is not None:
            st = os.stat(blocked)
            raise SystemExit(
                f"lifl: the service user {who} runs the gateway and redis-server and cannot reach {purpose} {directory}: "
                f"{blocked} ({stat.filemode(st.st_mode)}, owner {_owner(st)}) does not let it pass; make that "
                f"directory searchable by the service user (e.g. chmod o+x {blocked}), or choose another with --service-user")


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def prepare_data_dir(data_dir: Path, service: Identity, *, hosts_redis: bool) -> None:
    """DATA_DIR: root's alone, except that the service user passes through to an embedded redis's directory."""
    data_dir.mkdir(parents=True, exist_ok=True)
    me = current()
    if hosts_redis and service != me:
        os.chown(data_dir, me.uid, service.gid)
        os.chmod(data_dir, DATA_DIR_MODE)
    else:
        os.chmod(data_dir, PRIVATE_DIR_MODE)


def make_private_tree(top: Path, owner: Identity) -> None:
    """Make ``top`` (created if missing) and everything in it ``owner``'s: directories 0700,
    files 0600 — also what an earlier run as another user left there. Never follows a symbolic
    link and leaves alone files with other hard links: a compromised owner could plant them to
    have root hand it files from elsewhere."""
    top.mkdir(parents=True, exist_ok=True)
    _make_private(str(top), None, owner)
    for _, dirs, files, dir_fd in os.fwalk(top, follow_symlinks=False):
        for name in dirs + files:
            _make_private(name, dir_fd, owner)


def _make_private(name: str, dir_fd: int | None, owner: Identity) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return  # a symbolic link (ELOOP), a socket (ENXIO), or gone meanwhile
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            mode = PRIVATE_DIR_MODE
        elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            mode = PRIVATE_FILE_MODE
        else:
            return
        if (st.st_uid, st.st_gid) != (owner.uid, owner.gid):
            os.fchown(fd, owner.uid, owner.gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def checkpoint_directory(spec: str, data_dir: Path) -> Path | None:
    """The directory a ``--checkpoints`` spelling keeps checkpoints in (None: not a directory store)."""
    if spec == "":
        return data_dir / "checkpoints"
    if spec.startswith("dir:"):
        return Path(spec[4:])
    return None


def secure_checkpoints(spec: str, data_dir: Path) -> None:
    """Checkpoints hold models' bytes: their directory is the agent's alone (0700)."""
    directory = checkpoint_directory(spec, data_dir)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, PRIVATE_DIR_MODE)


def peer_identity(sock: socket.socket) -> Identity:
    """Who is at the other end of a unix socket, as the kernel recorded it when it connected."""
    _pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Identity(uid, gid)


def attach_refusal(tenant_uid: int | None, tenant_name: str, peer: Identity, agent: Identity) -> str | None:
    """Why a process may not attach as one of ``tenant_name``'s function instances, or None if it
    may. Isolated (the tenant has a uid): it must run as exactly the tenant's uid and gid, which
    is what lets it open the tenant's objects and nothing else; not isolated: as the agent's user."""
    if tenant_uid is None:
        if peer.uid != agent.uid:
            return f"functions of this node run as the agent's user (uid {agent.uid}); this one runs as uid {peer.uid}"
        return None
    if (peer.uid, peer.gid) != (tenant_uid, tenant_uid):
        return (f"tenant {tenant_name!r}'s functions must run as uid {tenant_uid} and gid {tenant_uid} "
                f"(a pod's securityContext runAsUser and runAsGroup); this one runs as {peer.uid}:{peer.gid}")
    return None
