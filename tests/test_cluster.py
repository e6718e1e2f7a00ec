"""`lifl up --nodes N`: nodes in network namespaces on one bridge, link shaping, failure and cleanup.

The spec and config checks are pure. The cluster tests need root and use a prefix, subnet and node
ids of their own (bridge lifltbr0, 10.78.0.0/24, nodes ct1..ctN), so they never touch a cluster a
user runs with the defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from conftest import wait_for
from lifl import cli
from lifl import format as fmt
from lifl.client import Gateway
from lifl.control.controller import ControlConfig
from lifl.net.flags import limit_argv
from lifl.net.limits import ConnectionLimits
from lifl.node import netns
from lifl.node.cluster import Cluster, ClusterAddresses, ClusterConfig, node_argv

PREFIX, SUBNET, STEM = "liflt", "10.78.0.0/24", "ct"
root_cluster = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, veth links and a bridge"),
]


def cluster_test(test):
    """Marks a test that starts clusters: slow, root only."""
    for mark in root_cluster:
        test = mark(test)
    return test


# -- pure: the shaping spec, the configuration, the command line ---------------------------------------

@pytest.mark.parametrize("spec, rate_bits", [
    ("rate 10gbit delay 0.1ms", 10_000_000_000),
    ("rate 100mbit", 100_000_000),
    ("rate 500kbit", 500_000),
    ("rate 1gbps", 8_000_000_000),  # tc: ...bps is bytes per second
    ("rate 1.5Mbit", 1_500_000),  # tc reads units case-insensitively
    ("rate 2mibit", 2 * 2**20),
    ("rate 9600", 9600),  # no unit: bits per second
    ("rate 10mbit 20 1500 -4", 10_000_000),  # packet overhead, cell size, cell overhead
    ("delay 10ms 2ms 25%", None),
    ("delay 10ms 2ms distribution normal", None),
    ("loss 0.1%", None),
    ("loss random 1% 25%", None),
    ("loss gemodel 1% 10%", None),
    ("duplicate 1 corrupt 0.1% reorder 25% 50% gap 5", None),
    ("limit 1000 ecn", None),
])
def test_valid_netem_specs(spec: str, rate_bits: int | None) -> None:
    parsed = netns.parse_netem(spec)
    assert parsed.rate_bits == rate_bits
    assert parsed.qdisc(netem=True) == ["netem", *spec.split()]  # with netem: verbatim


@pytest.mark.parametrize("spec, error", [
    ("", "empty spec"),
    ("   ", "empty spec"),
    ("rate", "'rate' needs a rate"),
    ("rate fast", "not a tc rate"),
    ("rate 10 gbit", "unknown option 'gbit'"),
    ("rate 10gbits", "not a tc rate"),
    ("rate 0mbit", "must be positive"),
    ("rate -1mbit", "not a tc rate"),
    ("rate 10%", "needs a link speed"),
    ("rate 1mbit rate 2mbit", "given twice"),
    ("delay", "'delay' needs a time"),
    ("delay 10parsecs", "'delay' needs a time"),
    ("delay -1ms", "'delay' needs a time"),
    ("loss 150%", "'loss' needs a percentage"),
    ("loss state", "'loss' needs a percentage"),
    ("jitter 1ms", "unknown option 'jitter'"),
    ("limit 0", "'limit' needs a positive integer"),
    ("bandwidth 1gbit", "unknown option 'bandwidth'"),
])
def test_invalid_netem_specs_are_refused_with_the_reason(spec: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        netns.parse_netem(spec)


def test_without_netem_the_rate_is_emulated_with_tbf_and_anything_else_refused() -> None:
    assert netns.parse_netem("rate 100mbit").qdisc(netem=False) == [
        "tbf", "rate", "100000000bit", "burst", str(64 << 10), "limit", str((64 << 10) + (16 << 20))]
    tbf = netns.parse_netem("rate 10gbit").qdisc(netem=False)
    assert tbf[tbf.index("burst") + 1] == str(10_000_000_000 // 8 // 250)  # 4 ms of traffic
    for spec, named in [("rate 10gbit delay 0.1ms", "delay"), ("delay 1ms", "delay"),
                        ("rate 1gbit loss 1% duplicate 1%", "loss, duplicate"), ("rate 1gbit 20", "overheads")]:
        with pytest.raises(ValueError, match="CONFIG_NET_SCH_NETEM") as refused:
            netns.parse_netem(spec).qdisc(netem=False)
        assert named in str(refused.value)


def test_cluster_config_names_addresses_and_node_options(tmp_path: Path) -> None:
    c = ClusterConfig(nodes=3, prefix=PREFIX, subnet=SUBNET, run_dir=tmp_path / "run", data_dir=tmp_path / "data",
                      shm_capacity=1 << 30, keep_warm=5, reuse=False, control=ControlConfig(placement="worstfit"))
    assert list(c.node_configs) == ["n1", "n2", "n3"]
    n3 = c.node_configs["n3"]
    assert (n3.http, n3.grpc) == ("10.78.0.13:8080", "10.78.0.13:50051")
    assert (n3.run_dir, n3.data_dir) == (tmp_path / "run/n3", tmp_path / "data/n3")
    assert c.network.bridge == "lifltbr0" and str(c.network.bridge_address) == "10.78.0.1"
    assert (c.network.namespace("n3"), c.network.host_end("n3")) == ("liflt-n3", "liflt-n3h")
    argv = node_argv(dataclasses.replace(n3, redis="unix:///r.sock"))
    limits = limit_argv(ConnectionLimits())
    assert "--no-reuse" in argv  # the agent's flags pass through to every node
    argv.remove("--no-reuse")
    options = dict(zip(argv[4::2], argv[5::2]))
    assert argv[1:4] == ["-m", "lifl", "up"] and options == {
        "--node": "n3", "--http": "10.78.0.13:8080", "--grpc": "10.78.0.13:50051", "--redis": "unix:///r.sock",
        "--run-dir": str(tmp_path / "run/n3"), "--data-dir": str(tmp_path / "data/n3"),
        "--checkpoints": f"dir:{tmp_path / 'data/checkpoints'}",  # shared: any node can restore any job
        "--shm-limit": str(1 << 30), "--pool-limit": str(1 << 28), "--max-instances": "16", "--keep-warm": "5",
        "--placement": "worstfit", "--capacity": "20.0", "--ewma-alpha": "0.7", "--plan-period": "2.0", "--channel": "auto", "--functions": "processes",
        "--retain-budget": "0", "--model-idle": "60.0",
        **dict(zip(limits[::2], limits[1::2])),  # the gateway's connection limits too
    }


@pytest.mark.parametrize("options, error", [
    ({"nodes": 0}, "between 1 and 200"),
    ({"nodes": 201}, "between 1 and 200"),
    ({"nodes": 5, "subnet": "10.78.0.0/28"}, "room for 4 nodes"),
    ({"subnet": "10.78.0.1/24"}, "host bits"),
    ({"prefix": "toolongprefix"}, "1-8 lowercase"),
    ({"prefix": "Lifl"}, "1-8 lowercase"),
    ({"node_stem": "N"}, "node id must be"),
    ({"node_stem": "abcdefgh"}, "longer than 15"),  # abcdefgh1 + prefix: interface names too long
    ({"redis": "redis://127.0.0.1:6379"}, "loopback of its own"),
    ({"redis": "redis://localhost"}, "loopback of its own"),
    ({"redis": "redis://[::1]:6379"}, "loopback of its own"),
    ({"redis": "http://10.0.0.1"}, "redis://, rediss:// or unix://"),
    ({"netem": "delay"}, "'delay' needs a time"),
])
def test_cluster_config_refuses_bad_options(tmp_path: Path, options: dict, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        ClusterConfig(**{"prefix": PREFIX, "subnet": SUBNET, "run_dir": tmp_path, "data_dir": tmp_path, **options})


def test_starting_a_cluster_needs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="--nodes needs root"):
        Cluster(ClusterConfig(prefix=PREFIX, subnet=SUBNET, run_dir=tmp_path, data_dir=tmp_path)).start()


def test_a_unix_socket_redis_is_accepted(tmp_path: Path) -> None:
    c = ClusterConfig(redis="unix:///tmp/r.sock", run_dir=tmp_path, data_dir=tmp_path)
    assert all(n.redis == "unix:///tmp/r.sock" for n in c.node_configs.values())


@pytest.mark.parametrize("argv, error", [
    (["up", "--netem", "rate 1gbit"], "--netem is about the links between emulated nodes"),
    (["up", "--subnet", "10.9.0.0/24"], "--subnet is about the links"),
    (["up", "--nodes", "0"], "between 1 and 200"),
    (["up", "--nodes", "201"], "between 1 and 200"),
    (["up", "--nodes", "2", "--http", "127.0.0.1:0"], "--http and --grpc are for one node"),
    (["up", "--nodes", "2", "--netem", "delay 1ms loss"], "'loss' needs a percentage"),
    (["up", "--nodes", "2", "--redis", "redis://127.0.0.1"], "loopback of its own"),
])
def test_the_command_line_refuses_before_starting_anything(argv: list[str], error: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(error)):
        cli.main(argv)


# -- helpers for the cluster tests ------------------------------------------------------------------

def node_ids(n: int) -> list[str]:
    return [f"{STEM}{k}" for k in range(1, n + 1)]


def config(base: Path, nodes: int, **options) -> ClusterConfig:
    return ClusterConfig(nodes=nodes, node_stem=STEM, prefix=PREFIX, subnet=SUBNET, run_dir=base / "run",
                         data_dir=base / "data", shm_capacity=256 << 20, keep_warm=30, **options)


def healthz(http: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{http}/healthz", timeout=30) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def shm_objects(nodes: list[str]) -> list[str]:
    return sorted(p.name for node in nodes for p in Path("/dev/shm").glob(f"lifl-{node}-*"))


def processes_in(base: Path) -> list[int]:
    """Processes whose command line names a path under ``base``, or that work in one (redis-server
    rewrites its command line, but works in its --dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (str(base).encode() in (p / "cmdline").read_bytes()
                                     or (p / "cwd").resolve().is_relative_to(base)):
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


def leftovers(base: Path, nodes: list[str]) -> dict[str, list]:
    found = {"namespaces": netns.namespaces(PREFIX), "links": netns.links(PREFIX),
             "processes": processes_in(base), "shm": shm_objects(nodes)}
    return {what: items for what, items in found.items() if items}


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A base directory that tenant functions (other uids) can reach; whatever a failed test left
    with the test prefix is removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="lifl-cluster-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        for pid in processes_in(base):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        netns.cleanup(PREFIX)
        for name in shm_objects(node_ids(3)):
            (Path("/dev/shm") / name).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def base() -> Iterator[Path]:
    with scratch_dir() as path:
        yield path


MODEL = fmt.encode({"w": np.ones(1000, np.float32)})


def veth_bytes(link: str) -> tuple[int, int]:
    stats = Path("/sys/class/net") / link / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


# Run inside a node's namespace: create a job on another node, upload its model, download it back.
TRANSFER = """
import hashlib, sys
import numpy as np
from lifl import format as fmt
from lifl.client import Gateway
gw = Gateway(sys.argv[1])
blob = bytes(fmt.encode({"w": np.arange(int(sys.argv[3]), dtype=np.float32)}))
gw.create_job(sys.argv[2], 2)
gw.set_model(sys.argv[2], blob)
version, got = gw.model(sys.argv[2])
print(len(blob), version, hashlib.sha256(blob).hexdigest(), hashlib.sha256(bytes(got)).hexdigest())
"""


# -- a running 3-node cluster, shaped, on its own redis-server ----------------------------------------

Shaped = tuple[Cluster, ClusterAddresses]


@pytest.fixture(scope="class")
def shaped() -> Iterator[Shaped]:
    with scratch_dir() as path:
        cluster = Cluster(config(path, 3, netem="rate 200mbit"))
        try:
            yield cluster, cluster.start()
        finally:
            cluster.stop()


class TestRunningCluster:
    pytestmark = root_cluster

    def test_every_gateway_answers_from_the_root_namespace(self, shaped: Shaped) -> None:
        _, addresses = shaped
        assert list(addresses.nodes) == node_ids(3)
        assert addresses.redis.startswith("redis://10.78.0.1:")  # the embedded redis, on the bridge
        for k, a in enumerate(addresses.nodes.values(), 1):
            assert (a.http, a.grpc) == (f"10.78.0.{10 + k}:8080", f"10.78.0.{10 + k}:50051")
            assert healthz(a.http) == 200

    def test_nodes_talk_over_the_veth_and_bridge(self, shaped: Shaped) -> None:
        _, addresses = shaped
        n1, n2 = addresses.nodes["ct1"], addresses.nodes["ct2"]
        before = {link: veth_bytes(link) for link in (n1.host_end, n2.host_end)}
        done = subprocess.run(
            netns.exec_argv(n1.namespace, [sys.executable, "-c", TRANSFER, n2.http, "transfer", str(2_000_000)]),
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        size, version, sent, received = done.stdout.split()
        assert int(size) > 8_000_000 and version == "0" and sent == received
        (n1_rx, n1_tx), (n2_rx, n2_tx) = ((a - b for a, b in zip(veth_bytes(link), before[link])) for link in before)
        # the upload left ct1's namespace through its veth and reached ct2 through ct2's; the download back
        assert n1_rx >= int(size) and n2_tx >= int(size)
        assert n2_rx >= int(size) and n1_tx >= int(size)

    def test_a_job_created_on_one_node_is_seen_on_another(self, shaped: Shaped) -> None:
        _, addresses = shaped
        one, three = Gateway(addresses.nodes["ct1"].http), Gateway(addresses.nodes["ct3"].http)
        one.create_job("shared", 4)
        assert three.job("shared")["goal"] == 4
        one.close()
        three.close()

    def test_links_are_shaped_both_ways(self, shaped: Shaped) -> None:
        _, addresses = shaped
        kind = addresses.shaping.split()[0]
        assert kind == ("netem" if netns.netem_available(PREFIX) else "tbf")
        for a in addresses.nodes.values():
            inside = netns.run(["tc", "-s", "-n", a.namespace, "qdisc", "show", "dev", "eth0"])
            outside = netns.run(["tc", "-s", "qdisc", "show", "dev", a.host_end])
            for shown in (inside, outside):
                assert f"qdisc {kind}" in shown and "rate 200Mbit" in shown, shown
                assert int(re.search(r"Sent (\d+) bytes", shown).group(1)) > 0

    def test_a_second_cluster_with_the_same_prefix_is_refused_and_harms_nothing(self, shaped: Shaped) -> None:
        _, addresses = shaped
        with tempfile.TemporaryDirectory() as other, pytest.raises(RuntimeError, match="already running"):
            Cluster(config(Path(other), 2)).start()
        assert sorted(netns.namespaces(PREFIX)) == [a.namespace for a in addresses.nodes.values()]
        assert all(healthz(a.http) == 200 for a in addresses.nodes.values())

    def test_the_embedded_redis_is_restarted_when_it_dies(self, shaped: Shaped) -> None:
        cluster, addresses = shaped
        redis_dir = cluster.config.data_dir / "redis"
        (pid,) = processes_in(redis_dir)
        os.kill(pid, signal.SIGKILL)
        client = redis.Redis.from_url(addresses.redis, socket_timeout=10)

        def restarted() -> bool:
            cluster.check()
            if processes_in(redis_dir) in ([], [pid]):
                return False
            with contextlib.suppress(redis.ConnectionError):
                return client.ping()
            return False

        wait_for(restarted, timeout=60, what="a new redis-server")
        one, two = Gateway(addresses.nodes["ct1"].http), Gateway(addresses.nodes["ct2"].http)
        one.create_job("after-redis", 2)  # the nodes carry on with the new one
        assert two.job("after-redis")["goal"] == 2
        one.close()
        two.close()

    def test_kill_node_leaves_the_other_nodes_answering(self, shaped: Shaped) -> None:  # last: it kills ct3
        cluster, addresses = shaped
        cluster.kill_node("ct3")
        assert netns.namespace_pids(addresses.nodes["ct3"].namespace) == []
        assert healthz(addresses.nodes["ct3"].http) == 0
        assert cluster.check() == ["ct3"] and cluster.check() == []  # reported once
        for node in ("ct1", "ct2"):
            assert healthz(addresses.nodes[node].http) == 200
        one, two = Gateway(addresses.nodes["ct1"].http), Gateway(addresses.nodes["ct2"].http)
        one.create_job("after-kill", 3)  # and they still work together
        assert two.job("after-kill")["goal"] == 3
        one.close()
        two.close()


# -- start, stop, failure ----------------------------------------------------------------------------

@cluster_test
@pytest.mark.parametrize("netem", ["delay 1ms", "rate 1gbit loss 1%"])
def test_without_netem_a_spec_beyond_rate_is_refused_before_anything_is_created(base: Path, netem: str) -> None:
    if netns.netem_available(PREFIX):
        pytest.skip("this kernel has netem: every spec is applied as given")
    with pytest.raises(ValueError, match="CONFIG_NET_SCH_NETEM"):
        Cluster(config(base, 2, netem=netem)).start()
    assert leftovers(base, node_ids(2)) == {}
    done = subprocess.run(up_command(base, 2) + ["--netem", netem], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "CONFIG_NET_SCH_NETEM" in done.stderr, done.stderr
    assert leftovers(base, node_ids(2)) == {}


@cluster_test
def test_stop_leaves_nothing_behind_even_after_a_node_was_killed(base: Path, redis_url: str) -> None:
    cluster = Cluster(config(base, 2, redis=redis_url))  # a unix socket reaches into every namespace
    try:
        addresses = cluster.start()
        gw = Gateway(addresses.nodes["ct2"].http)
        gw.create_job("j", 2)
        gw.set_model("j", MODEL)
        gw.close()
        wait_for(lambda: shm_objects(["ct2"]), what="the model in ct2's shared memory")
        cluster.kill_node("ct2")
        assert shm_objects(["ct2"])  # a killed agent leaves its objects: stop() must remove them
        assert healthz(addresses.nodes["ct1"].http) == 200
    finally:
        cluster.stop()
    assert leftovers(base, node_ids(2)) == {}
    cluster.stop()  # idempotent
    assert netns.cleanup(PREFIX).namespaces == []  # and so is cleanup, with nothing to do


def up_command(base: Path, nodes: int) -> list[str]:
    return [sys.executable, "-m", "lifl", "up", "--nodes", str(nodes), "--node", STEM, "--cluster-prefix", PREFIX,
            "--subnet", SUBNET, "--run-dir", str(base / "run"), "--data-dir", str(base / "data"), "--shm-limit", "256m"]


def start_up(base: Path, nodes: int, stderr: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """`lifl up --nodes N` as a subprocess, once it is up; with each node's HTTP address."""
    with open(stderr, "w") as err:
        proc = subprocess.Popen(up_command(base, nodes), stdout=subprocess.PIPE, stderr=err, text=True)
    http: dict[str, str] = {}
    assert proc.stdout is not None
    while len(http) < nodes:
        line = proc.stdout.readline()
        assert line, f"lifl up --nodes failed: {stderr.read_text()}"
        if m := re.fullmatch(r"  (\w+)  http://(\S+)  grpc \S+\n", line):
            http[m.group(1)] = m.group(2)
    return proc, http


@cluster_test
def test_a_cluster_killed_with_sigkill_is_cleaned_up_by_the_next_start(base: Path) -> None:
    first, _ = start_up(base, 2, base / "first.err")
    first.kill()
    first.wait()
    assert sorted(netns.namespaces(PREFIX)) == ["liflt-ct1", "liflt-ct2"]  # left behind
    second, http = start_up(base, 2, base / "second.err")
    try:
        assert "removed what a previous cluster 'liflt' left behind: 2 namespaces" in (base / "second.err").read_text()
        assert [healthz(address) for address in http.values()] == [200, 200]
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(120)
    assert second.returncode == 0
    assert leftovers(base, node_ids(2)) == {}
