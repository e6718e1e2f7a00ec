"""Network plumbing for `lifl up --nodes N`: a bridge, one network namespace per node, link shaping.

Every name derives from one prefix (default ``lifl``), so whatever a killed run left behind can
be found and removed by :func:`cleanup`:

    {prefix}br0            the bridge, in the root namespace, on the subnet's first address
    {prefix}-{node}        node k's network namespace; its eth0 has the subnet's address 10+k
    {prefix}-{node}h       the host end of node k's veth pair, attached to the bridge
    {prefix}-probe[p]      a short-lived veth pair: does this kernel have netem?

Traffic between nodes crosses the kernel's TCP stack and the veth/bridge path, as between
machines. Shaping (``--netem SPEC``) applies to both ends of each node's veth pair, so both
directions are shaped. Kernels without sch_netem (CONFIG_NET_SCH_NETEM unset) get the spec's
``rate`` from tbf; any other netem option is refused there rather than ignored.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

IFNAMSIZ = 15  # longest interface name the kernel accepts
FIRST_HOST = 10  # node k gets the subnet's address FIRST_HOST + k


class NetError(RuntimeError):
    """An ip or tc command failed."""


def run(argv: Sequence[str]) -> str:
    """Run ``argv``; its stdout, or NetError naming the command and what it printed."""
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise NetError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (ip netns exec execs it: its pid is the command's)."""
    return ["ip", "netns", "exec", namespace, *argv]


# -- names ----------------------------------------------------------------------------------------

def bridge_name(prefix: str) -> str:
    return f"{prefix}br0"


def namespace_name(prefix: str, node: str) -> str:
    return f"{prefix}-{node}"


def host_end_name(prefix: str, node: str) -> str:
    return f"{prefix}-{node}h"


def _probe_name(prefix: str) -> str:
    return f"{prefix}-probe"


@dataclass(frozen=True)
class Network:
    """The bridge and node addresses of one cluster: everything named from ``prefix``."""

    prefix: str = "lifl"
    subnet: str = "10.77.0.0/24"
    network: ipaddress.IPv4Network = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.prefix):
            raise ValueError(f"network prefix must be 1-8 lowercase letters or digits, starting with a letter; got {self.prefix!r}")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as e:
            raise ValueError(f"subnet must be an IPv4 network like 10.77.0.0/24: {e}") from None
        object.__setattr__(self, "network", net)
        if self.capacity < 1:
            raise ValueError(f"subnet {self.subnet} is too small: node addresses start at its {FIRST_HOST + 1}th address")

    @property
    def capacity(self) -> int:
        """How many nodes fit: addresses FIRST_HOST+1 .. broadcast-1."""
        return self.network.num_addresses - FIRST_HOST - 2

    @property
    def bridge(self) -> str:
        return bridge_name(self.prefix)

    @property
    def bridge_address(self) -> ipaddress.IPv4Address:
        return self.network[1]

    def namespace(self, node: str) -> str:
        return namespace_name(self.prefix, node)

    def host_end(self, node: str) -> str:
        name = host_end_name(self.prefix, node)
        if len(name) > IFNAMSIZ:
            raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ} characters: use a shorter prefix or node id")
        return name

    def address(self, k: int) -> ipaddress.IPv4Address:
        if not 1 <= k <= self.capacity:
            raise ValueError(f"node {k} does not fit in subnet {self.subnet} ({self.capacity} nodes at most)")
        return self.network[FIRST_HOST + k]


# -- creating ---------------------------------------------------------------------------------------

def create_bridge(net: Network) -> None:
    run(["ip", "link", "add", net.bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{net.bridge_address}/{net.network.prefixlen}", "dev", net.bridge])
    run(["ip", "link", "set", net.bridge, "up"])


def add_node(net: Network, node: str, k: int) -> None:
    """Node k's namespace, with eth0 (the far end of a veth pair on the bridge) and lo up."""
    ns, host = net.namespace(node), net.host_end(node)
    run(["ip", "netns", "add", ns])
    # the peer is created inside the namespace: no clash with the root namespace's own eth0
    run(["ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", host, "master", net.bridge])
    run(["ip", "link", "set", host, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{net.address(k)}/{net.network.prefixlen}", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", str(net.bridge_address)])


def shape(net: Network, node: str, qdisc: Sequence[str]) -> None:
    """Install ``qdisc`` (tc words after 'root') on both ends of the node's link."""
    run(["tc", "-n", net.namespace(node), "qdisc", "add", "dev", "eth0", "root", *qdisc])  # node → bridge
    run(["tc", "qdisc", "add", "dev", net.host_end(node), "root", *qdisc])  # bridge → node


def shape_between_nodes(net: Network, node: str, peers: Sequence[ipaddress.IPv4Address], rate_bits: int) -> None:
    """Shape only the traffic between this node and ``peers`` (the other nodes), both ways, with
    an htb class of ``rate_bits``: what crosses the cluster's network is limited, clients' and
    Redis's traffic to and from the bridge address is not (htb sends unclassified packets
    straight through)."""
    burst = str(max(rate_bits // 8 // 250, 64 << 10))
    klass = ["htb", "rate", f"{rate_bits}bit", "ceil", f"{rate_bits}bit", "burst", burst, "cburst", burst]
    for tc, dev, direction in ((["tc", "-n", net.namespace(node)], "eth0", "dst"), (["tc"], net.host_end(node), "src")):
        run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "r2q", "1000"])
        run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", *klass])
        for peer in peers:
            run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", direction, f"{peer}/32", "flowid", "1:10"])


def netem_available(prefix: str) -> bool:
    """Whether this kernel has the netem qdisc, tried on a scratch veth pair."""
    probe = _probe_name(prefix)
    run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"])
    try:
        result = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", "netem"], capture_output=True, text=True)
    finally:
        _delete_link(probe)
    if result.returncode == 0:
        return True
    if "unknown" in result.stderr.lower():  # "Specified qdisc kind is unknown."
        return False
    raise NetError(f"could not tell whether netem works: {result.stderr.strip()}")


# -- finding and removing -------------------------------------------------------------------------

def _all_namespaces() -> list[str]:
    return [ns["name"] for ns in json.loads(run(["ip", "-j", "netns", "list"]) or "[]")]


def namespaces(prefix: str) -> list[str]:
    """The network namespaces named from ``prefix``."""
    return [name for name in _all_namespaces() if name.startswith(prefix + "-")]


def links(prefix: str) -> list[str]:
    """The root namespace's interfaces named from ``prefix``: the bridge, veth host ends, probes."""
    listed = json.loads(run(["ip", "-j", "link", "show"]) or "[]")
    return [l["ifname"] for l in listed if l["ifname"].startswith(prefix + "-") or l["ifname"] == bridge_name(prefix)]


def namespace_pids(namespace: str) -> list[int]:
    """The processes in ``namespace`` (none if it does not exist)."""
    try:
        return [int(pid) for pid in run(["ip", "netns", "pids", namespace]).split()]
    except NetError:
        if namespace in _all_namespaces():
            raise
        return []


def kill_namespace(namespace: str, timeout: float = 15.0) -> int:
    """SIGKILL every process in ``namespace`` until none is left; how many there were. All are
    stopped first, so none reacts to another's death: the node fails as a whole machine would."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(namespace):
        if time.monotonic() > deadline:
            raise NetError(f"processes {pids} in namespace {namespace} outlive SIGKILL")
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        killed.update(pids)
        time.sleep(0.02)  # a killed process leaves the namespace once it has exited
    return len(killed)


@dataclass(frozen=True)
class Leftovers:
    """What :func:`cleanup` found and removed."""

    namespaces: list[str]
    links: list[str]
    processes: int

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.links or self.processes)

    def __str__(self) -> str:
        return (f"{len(self.namespaces)} namespaces ({', '.join(self.namespaces) or '-'}), "
                f"{len(self.links)} links ({', '.join(self.links) or '-'}), {self.processes} processes")


def cleanup(prefix: str) -> Leftovers:
    """Kill the processes in the prefix's namespaces, delete those, the veth pairs and the bridge.

    Idempotent: safe when nothing exists."""
    found = namespaces(prefix)
    killed = sum(kill_namespace(ns) for ns in found)
    found_links = links(prefix)
    for link in found_links:  # deleting a host end deletes the eth0 in its namespace too
        _delete_link(link)
    for ns in found:
        run(["ip", "netns", "delete", ns])
    return Leftovers(found, found_links, killed)


def _delete_link(name: str) -> None:
    try:
        run(["ip", "link", "delete", name])
    except NetError:
        if subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0:
            raise  # still there: a real failure, not a peer that went with its pair


# -- shaping spec -----------------------------------------------------------------------------------

# tc's rate units (case-insensitive, as tc reads them): bits, or bytes (…bps) per second
RATE_UNITS: dict[str, float] = {
    "": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}
TIME_UNITS = ("", "s", "sec", "secs", "ms", "msec", "msecs", "us", "usec", "usecs", "ns", "nsec", "nsecs")
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"

# netem's options and the kinds of their arguments ('?': optional), as tc-netem(8) has them
NETEM_OPTIONS: dict[str, tuple[str, ...]] = {
    "limit": ("count",),
    "delay": ("time", "time?", "percent?"),
    "distribution": ("name",),
    "loss": ("percent", "percent?"),
    "corrupt": ("percent", "percent?"),
    "duplicate": ("percent", "percent?"),
    "reorder": ("percent", "percent?"),
    "gap": ("count",),
    "rate": ("rate", "int?", "count?", "int?"),  # RATE [PACKETOVERHEAD [CELLSIZE [CELLOVERHEAD]]]
    "ecn": (),
}
LOSS_MODELS: dict[str, tuple[str, ...]] = {
    "random": ("percent", "percent?"),
    "state": ("percent", "percent?", "percent?", "percent?", "percent?"),
    "gemodel": ("percent", "percent?", "percent?", "percent?"),
}
_KIND_HINTS = {"count": "a positive integer", "int": "an integer", "time": "a time like 10ms",
               "percent": "a percentage like 1%", "rate": "a rate like 100mbit", "name": "a distribution name"}


def parse_rate(text: str) -> int:
    """Bits per second from a tc rate: '10gbit', '100mbit', '500kbit', '1gbps' (bytes: 8e9 bit/s)."""
    if text.endswith("%"):
        raise ValueError(f"rate {text!r}: a share of the link speed needs a link speed, which a veth does not have; "
                         "give bits or bytes per second, e.g. 100mbit")
    m = re.fullmatch(_NUMBER + r"([a-z]*)", text.lower())
    if not m or m.group(2) not in RATE_UNITS:
        raise ValueError(f"rate {text!r} is not a tc rate: a number with one of the units "
                         "bit kbit mbit gbit tbit (bits/s), bps kbps mbps gbps tbps (bytes/s), or kibit… kibps…")
    bits = round(float(m.group(1)) * RATE_UNITS[m.group(2)])
    if bits <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return bits


def _valid(kind: str, token: str) -> bool:
    if kind == "count":
        return token.isascii() and token.isdigit() and int(token) > 0
    if kind == "int":
        return re.fullmatch(r"-?\d+", token) is not None
    if kind == "time":
        m = re.fullmatch(_NUMBER + r"([a-z]*)", token.lower())
        return m is not None and m.group(2) in TIME_UNITS
    if kind == "percent":
        m = re.fullmatch(_NUMBER + "%?", token)
        return m is not None and float(m.group(1)) <= 100
    if kind == "name":
        return re.fullmatch(r"[a-z][a-z0-9_-]*", token) is not None
    try:
        parse_rate(token)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class NetemSpec:
    """A validated netem spec: its options (keyword → argument tokens) in the order given."""

    text: str
    options: dict[str, tuple[str, ...]]

    @property
    def rate_bits(self) -> int | None:
        return parse_rate(self.options["rate"][0]) if "rate" in self.options else None

    def qdisc(self, netem: bool) -> list[str]:
        """The tc qdisc words that apply this spec: netem verbatim, or (no netem) tbf for its rate."""
        if netem:
            return ["netem", *self.text.split()]
        others = [k for k in self.options if k != "rate"]
        if others or len(self.options["rate"]) > 1:
            what = ", ".join(others) if others else "rate's packet and cell overheads"
            raise ValueError(f"--netem {self.text!r}: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set), "
                             f"so only 'rate' can be emulated (with tbf); {what} cannot be. "
                             "Drop those options or use a kernel with sch_netem")
        rate = self.rate_bits
        assert rate is not None
        return tbf_args(rate)


def tbf_args(rate_bits: int) -> list[str]:
    """tbf for a netem rate: a burst of 4 ms of traffic (64 KiB at least) and a queue that takes a
    burst of several MB without dropping (16 MiB beyond the burst)."""
    burst = max(rate_bits // 8 // 250, 64 << 10)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(burst + (16 << 20))]


def parse_netem(spec: str) -> NetemSpec:
    """Validate a netem spec (tc-netem(8) syntax) without touching the system."""
    tokens = spec.split()
    if not tokens:
        raise ValueError("--netem: empty spec; give netem options such as 'rate 10gbit delay 0.1ms'")
    options: dict[str, tuple[str, ...]] = {}
    i = 0
    while i < len(tokens):
        keyword = tokens[i]
        if keyword not in NETEM_OPTIONS:
            raise ValueError(f"--netem {spec!r}: unknown option {keyword!r} (known: {', '.join(NETEM_OPTIONS)})")
        if keyword in options:
            raise ValueError(f"--netem {spec!r}: {keyword!r} given twice")
        kinds, prefix = NETEM_OPTIONS[keyword], ()
        if keyword == "loss" and i + 1 < len(tokens) and tokens[i + 1] in LOSS_MODELS:
            kinds, prefix, i = LOSS_MODELS[tokens[i + 1]], (tokens[i + 1],), i + 1
        args, i = _take_args(spec, keyword, kinds, tokens, i + 1)
        options[keyword] = prefix + args
    return NetemSpec(" ".join(tokens), options)


def _take_args(spec: str, keyword: str, kinds: tuple[str, ...], tokens: list[str], i: int) -> tuple[tuple[str, ...], int]:
    args: list[str] = []
    for kind in kinds:
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        token = tokens[i] if i < len(tokens) else None
        if token is not None and token not in NETEM_OPTIONS and _valid(kind, token):
            args.append(token)
            i += 1
        elif optional:
            break
        elif kind == "rate" and token is not None:
            parse_rate(token)  # raises with the precise reason
        else:
            got = f"got {token!r}" if token is not None else "got nothing"
            raise ValueError(f"--netem {spec!r}: {keyword!r} needs {_KIND_HINTS[kind]}, {got}")
    return tuple(args), i
