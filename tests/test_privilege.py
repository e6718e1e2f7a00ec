"""Least privilege on a node run by root: the gateway and redis run as the service user, their
data is theirs alone, and the operator's token is set at start (lifl.node.privilege, operator_token)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from conftest import wait_for
from lifl import format as fmt
from lifl.auth import Tokens
from lifl.node.cluster import ClusterConfig, node_argv
from lifl.node.operator_token import ENVIRONMENT_VARIABLE, FILE_NAME
from lifl.node.privilege import (
    SERVICE_FALLBACK_ID, SERVICE_USER, Identity, make_private_tree, service_identity,
)
from lifl.node.supervisor import Node, NodeConfig
from lifl.state import TENANT_UID_BASE

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")]

UNRELATED = Identity(65534, 65534)  # nobody
TENANT = Identity(TENANT_UID_BASE + 4242, TENANT_UID_BASE + 4242)
TOKEN = "an-operator-token-of-the-operators-own-making"


@pytest.fixture
def start_node(run_dir: Path, shm_node: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Node]]:
    """Start a real node with its own embedded redis, as `lifl up` does; stopped after the test."""
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)  # each test says where the token comes from
    nodes: list[Node] = []

    def start(**options: Any) -> Node:
        config = NodeConfig(node=shm_node, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=run_dir,
                            data_dir=run_dir.parent / "data", shm_capacity=1 << 30, **options)
        node = Node(config)
        nodes.append(node)
        node.start()
        return node

    yield start
    for node in nodes:
        node.stop()


def ids(pid: int) -> dict[str, list[int]]:
    """The real, effective, saved and file-system uids and gids of a process, and its groups."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: [int(x) for x in fields[name].split()] for name in ("Uid", "Gid", "Groups")}


def runs_as(pid: int, who: Identity) -> bool:
    return ids(pid) == {"Uid": [who.uid] * 4, "Gid": [who.gid] * 4, "Groups": []}


PROBE = r"""
import json, os, socket, sys
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
results = {}
for kind, path in json.loads(sys.argv[3]):
    try:
        if kind == "read":
            open(path, "rb").close()
        elif kind == "list":
            os.listdir(path)
        else:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
        results[path] = "allowed"
    except PermissionError:
        results[path] = "denied"
print(json.dumps(results))
"""


def attempt(who: Identity, checks: list[tuple[str, Path]]) -> dict[str, str]:
    """What ``who`` may do: read a file, list a directory or connect to a socket, by path. (The
    probe becomes ``who`` once started: the interpreter may live where ``who`` cannot read.)"""
    checks_json = json.dumps([(kind, str(path)) for kind, path in checks])
    done = subprocess.run([sys.executable, "-I", "-c", PROBE, str(who.uid), str(who.gid), checks_json],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def request(node: Node, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP request to the node's gateway, with the operator's token."""
    assert node.addresses is not None
    host, port = node.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body, {**(headers or {}), "Authorization": f"Bearer {token or node.operator_token}"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def create_job(node: Node, token: str) -> int:
    return request(node, "POST", "/v1/jobs", json.dumps({"job": "j", "goal": 1}).encode(), token=token)[0]


def healthy(node: Node) -> bool:
    assert node.addresses is not None
    host, port = node.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def role_of(node: Node, token: str) -> str:
    assert node.addresses is not None
    with redis.Redis.from_url(node.addresses.redis, decode_responses=True) as client:
        return Tokens(client).authenticate(token).role


def files_under(directory: Path) -> list[Path]:
    return [Path(root) / name for root, dirs, files in os.walk(directory) for name in dirs + files]


def test_the_gateway_and_redis_run_as_the_service_user_and_the_agent_as_root(start_node: Callable[..., Node]) -> None:
    node = start_node()
    service = service_identity()
    assert service.uid != 0 and node.drops_privileges
    assert runs_as(node.children["gateway"].proc.pid, service)
    assert runs_as(node.children["redis"].proc.pid, service)
    assert ids(node.children["agent"].proc.pid)["Uid"] == [0] * 4
    # and it still does its work: shared-memory objects reach it as descriptors, never by name
    model = fmt.encode({"w": np.ones(1000, np.float32)})
    assert create_job(node, node.operator_token) == 201
    assert request(node, "PUT", "/v1/jobs/j/model", model)[0] == 201
    assert request(node, "GET", "/v1/jobs/j/model") == (200, model)
    update = {"X-Lifl-Client": "c", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"}
    assert request(node, "POST", "/v1/jobs/j/updates", model, update)[0] == 202
    wait_for(lambda: json.loads(request(node, "GET", "/v1/jobs/j")[1])["version"] == 1, what="version 1")


def test_the_service_user_is_lifl_or_else_a_fixed_id_below_the_tenants() -> None:
    try:
        import pwd

        entry = pwd.getpwnam(SERVICE_USER)
        expected = Identity(entry.pw_uid, entry.pw_gid)
    except KeyError:
        expected = Identity(SERVICE_FALLBACK_ID, SERVICE_FALLBACK_ID)
    assert service_identity() == expected and expected.uid < TENANT_UID_BASE
    assert service_identity("nobody") == service_identity("65534") == UNRELATED
    assert service_identity("root") == Identity(0, 0)  # keeps them root, as before
    assert service_identity("123456") == Identity(123456, 123456)  # no passwd entry: its gid is the same number
    with pytest.raises(ValueError, match="are the tenants'"):
        service_identity(str(TENANT_UID_BASE))
    with pytest.raises(ValueError, match="no such user"):
        service_identity("no-such-user-here")


def test_redis_data_is_the_service_users_alone(start_node: Callable[..., Node]) -> None:
    node = start_node()
    service, data = service_identity(), node.config.data_dir
    assert data is not None
    assert create_job(node, node.operator_token) == 201
    aof = data / "redis" / "appendonlydir"
    wait_for(lambda: any(b"lifl:job" in p.read_bytes() for p in aof.glob("*.aof")), what="the job in the AOF")
    st = os.stat(data)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, service.gid, 0o710)  # passage to redis/ only
    for path in [data / "redis", *files_under(data / "redis")]:
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (service.uid, service.gid), path
        assert stat.S_IMODE(st.st_mode) == (0o700 if stat.S_ISDIR(st.st_mode) else 0o600), path
    for path, mode in ((data / "checkpoints", 0o700), (data / FILE_NAME, 0o600)):
        st = os.stat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, mode), path


def test_other_users_are_denied_the_nodes_data_and_sockets(start_node: Callable[..., Node]) -> None:
    node = start_node()
    data = node.config.data_dir
    assert data is not None and node.addresses is not None
    assert create_job(node, node.operator_token) == 201
    aof_files = sorted((data / "redis" / "appendonlydir").iterdir())
    agent_socket, redis_socket = node.run_dir / "agent.sock", Path(node.addresses.redis.removeprefix("unix://"))
    sockets = [("connect", agent_socket), ("connect", redis_socket)]
    secrets = [("read", p) for p in aof_files] + [("read", data / FILE_NAME), ("list", data / "checkpoints")]

    assert set(attempt(UNRELATED, secrets + sockets).values()) == {"denied"}
    assert set(attempt(TENANT, sockets).values()) == {"denied"}
    # the service user reaches its sockets and its redis's files, and nothing else of the data directory
    service = attempt(service_identity(), [*sockets, ("read", aof_files[0]), ("list", data), ("read", data / FILE_NAME)])
    assert service == {str(agent_socket): "allowed", str(redis_socket): "allowed", str(aof_files[0]): "allowed",
                       str(data): "denied", str(data / FILE_NAME): "denied"}


def closed_to_others(directory: Path) -> Path:
    """``directory``, root's and 0700: as a /var/lib/lifl that something else left behind."""
    directory.mkdir()
    os.chmod(directory, 0o700)
    return directory


def refusal(data_dir: Path, blocked: Path) -> str:
    """What `lifl up` says when the service user cannot pass ``blocked`` on the way to its redis's directory."""
    return (f"lifl: the service user {service_identity()} runs the gateway and redis-server and cannot reach "
            f"redis-server's directory {data_dir / 'redis'}: {blocked} (drwx------, owner root:root) does not let it pass; "
            f"make that directory searchable by the service user (e.g. chmod o+x {blocked}), or choose another with --service-user")


def refused_start(node_id: str, run_dir: Path, data_dir: Path) -> tuple[Node, SystemExit]:
    """A node that refuses to start, stopped again; and what it said."""
    node = Node(NodeConfig(node=node_id, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=run_dir, data_dir=data_dir,
                           shm_capacity=1 << 30))
    try:
        with pytest.raises(SystemExit) as refused:
            node.start()
    finally:
        node.stop()
    return node, refused.value


def test_a_data_dir_the_service_user_cannot_get_to_is_refused_before_redis_starts(run_dir: Path, shm_node: str) -> None:
    blocked = closed_to_others(run_dir.parent / "lib")
    data_dir = blocked / shm_node
    node, refused = refused_start(shm_node, run_dir, data_dir)
    assert str(refused) == refusal(data_dir, blocked)
    assert node.children == {}  # neither redis-server nor anything after it was started
    assert not (data_dir / "redis").exists()


@pytest.mark.parametrize("cluster", [False, True], ids=["lifl up", "lifl up --nodes 2"])
def test_lifl_up_names_the_directory_in_the_way_instead_of_redis_servers_error(run_dir: Path, shm_node: str,
                                                                              cluster: bool) -> None:
    blocked = closed_to_others(run_dir.parent / "lib")
    data_dir = blocked / "cluster" if cluster else blocked / shm_node
    argv = [sys.executable, "-m", "lifl", "up", "--run-dir", str(run_dir), "--data-dir", str(data_dir), "--shm-limit", "256m"]
    if cluster:  # a prefix and subnet of this test's own (tests/test_cluster.py has liflt and 10.78.0.0/24)
        argv += ["--nodes", "2", "--node", "pv", "--cluster-prefix", "liflpv", "--subnet", "10.81.0.0/24"]
    else:
        argv += ["--node", shm_node, "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == refusal(data_dir, blocked), done.stderr
    assert "FATAL" not in done.stderr and "is up" not in done.stdout


def test_a_generated_operator_token_is_private_registered_and_kept(start_node: Callable[..., Node]) -> None:
    node = start_node()
    assert node.config.data_dir is not None
    path = node.config.data_dir / FILE_NAME
    assert node.operator_token_source == str(path)
    assert path.read_text().strip() == node.operator_token and len(node.operator_token) >= 32
    assert role_of(node, node.operator_token) == "operator"
    first = node.operator_token
    node.stop()
    again = start_node()
    assert again.operator_token == first


def test_the_operator_token_from_the_environment_is_registered(start_node: Callable[..., Node],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, TOKEN)
    node = start_node()
    assert node.operator_token == TOKEN and role_of(node, TOKEN) == "operator"
    assert create_job(node, TOKEN) == 201
    assert node.config.data_dir is not None and not (node.config.data_dir / FILE_NAME).exists()


def test_the_operator_token_from_a_file_is_registered(start_node: Callable[..., Node], tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")  # whitespace around it does not count
    node = start_node(operator_token_file=token_file)
    assert node.operator_token == TOKEN and role_of(node, TOKEN) == "operator"
    assert node.operator_token_source == str(token_file)


@pytest.mark.parametrize("token, given_by, error", [
    ("too-short", "environment", "operator token from $LIFL_OPERATOR_TOKEN is not valid"),
    ("too-short", "file", "operator token from {file} is not valid"),
    ("", "file", "operator token file {file} is empty"),
    (TOKEN + " with spaces", "file", "32-256 printable ASCII characters without spaces"),
    (TOKEN, "both", "from $LIFL_OPERATOR_TOKEN or --operator-token-file, not both"),
])
def test_a_bad_operator_token_refuses_to_start(run_dir: Path, shm_node: str, tmp_path: Path,
                                               token: str, given_by: str, error: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items() if k != ENVIRONMENT_VARIABLE}
    argv = [sys.executable, "-m", "lifl", "up", "--node", shm_node, "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
            "--run-dir", str(run_dir), "--data-dir", str(run_dir.parent / "data"), "--shm-limit", "256m"]
    if given_by in ("file", "both"):
        argv += ["--operator-token-file", str(token_file)]
    if given_by in ("environment", "both"):
        env[ENVIRONMENT_VARIABLE] = token
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and error.format(file=token_file) in done.stderr, done.stderr
    assert "is up" not in done.stdout


def test_a_killed_gateway_comes_back_as_the_service_user(start_node: Callable[..., Node]) -> None:
    node = start_node()
    supervisor = threading.Thread(target=node.supervise, daemon=True)  # restarts the gateway
    supervisor.start()
    old = node.children["gateway"].proc.pid
    os.kill(old, signal.SIGKILL)
    # it drops before it accepts connections: once it answers, it has dropped
    wait_for(lambda: node.children["gateway"].proc.pid != old and healthy(node), what="the gateway back on its port")
    assert runs_as(node.children["gateway"].proc.pid, service_identity())
    assert create_job(node, node.operator_token) == 201
    node.stop()
    supervisor.join(60)


def test_files_left_by_a_root_run_become_the_service_users_and_links_are_not_followed(tmp_path: Path) -> None:
    service = service_identity()
    outside = tmp_path / "outside"  # root's, elsewhere: a compromised service user must not be handed it
    outside.write_text("root's")
    os.chmod(outside, 0o644)
    top = tmp_path / "redis"
    (top / "appendonlydir").mkdir(parents=True)
    old = top / "appendonlydir" / "appendonly.aof.1.incr.aof"
    old.write_text("a model's bytes")
    os.chmod(old, 0o644)
    (top / "planted").symlink_to(outside)
    os.link(outside, top / "linked")
    make_private_tree(top, service)
    for path in (top, top / "appendonlydir", old):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (service.uid, service.gid)
        assert stat.S_IMODE(st.st_mode) == (0o700 if path.is_dir() else 0o600)
    st = os.stat(outside)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o644)


def test_every_node_of_a_cluster_gets_the_clusters_operator_token_and_service_user(tmp_path: Path) -> None:
    config = ClusterConfig(nodes=2, prefix="liflt", subnet="10.78.0.0/24", run_dir=tmp_path / "run",
                           data_dir=tmp_path / "data", shm_capacity=1 << 30, service_user="nobody")
    argv = node_argv(dataclasses.replace(config.node_configs["n1"], redis="unix:///r.sock"), tmp_path / "data" / FILE_NAME)
    options = dict(zip(argv[4::2], argv[5::2]))
    assert options["--operator-token-file"] == str(tmp_path / "data" / FILE_NAME)
    assert options["--service-user"] == "nobody"


def test_an_embedded_redis_that_exits_while_starting_is_named_at_once_with_its_log(run_dir: Path, shm_node: str) -> None:
    """A dead redis-server is not waited for (the wait bounds only one that is alive): its exit
    status and its log are named, and nothing after it starts."""
    data_dir = run_dir.parent / "lib"
    aof = data_dir / "redis" / "appendonlydir"
    aof.mkdir(parents=True)
    (aof / "appendonly.aof.manifest").write_text("not a manifest\n")  # redis-server refuses to load it, and exits
    service = service_identity()
    for path in (data_dir, data_dir / "redis", aof, aof / "appendonly.aof.manifest"):
        os.chown(path, service.uid, service.gid)
    node, refused = refused_start(shm_node, run_dir, data_dir)
    log = data_dir / "redis" / "redis.log"
    assert str(refused).startswith("lifl: the embedded redis-server exited (") and str(refused).endswith(f"its log: {log}")
    assert "manifest" in log.read_text().lower(), log.read_text()
    assert set(node.children) == {"redis"}
