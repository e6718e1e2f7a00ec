"""lifl's container images (scripts/images.sh), built for real with podman and then run.

The suite builds from a snapshot of this checkout (LIFL_SOURCE_ROOT) into the usual cache, so a
second run reuses the images of the first; a changed source tree is built in a cache of its own,
seeded with the usual cache's archives, so the usual images stay those of the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "images.sh"
CACHE = Path(os.environ.get("LIFL_TESTENV_CACHE") or Path.home() / ".cache" / "lifl-testenv")
BUILD_TIMEOUT_S = 1800  # bounds a failure only: a cold build on a loaded 2-core machine takes minutes
CONTAINERD_START_TIMEOUT_S = 60  # bounds a failure only
# what a snapshot of the checkout leaves out: environments, history, build outputs
SNAPSHOT_IGNORED = (".venv", ".git", "results", "build", "__pycache__", "*.egg-info", ".pytest_cache")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="building images needs root (mmdebstrap, podman's store)"),
    pytest.mark.timeout(BUILD_TIMEOUT_S),
]

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
BASE = "dev.local/lifl/base:bookworm"
NODE_BASE = "dev.local/lifl/node-base:bookworm"
NODE = f"dev.local/lifl/lifl:{VERSION}"
FUNCTION = f"dev.local/lifl/aggregator:{VERSION}"
PAUSE = "dev.local/lifl/pause:3.10"
QUEUE_BINARY_NAME = "knative-queue"


def images_sh(*args: str, source: Path | None = None, cache: Path = CACHE,
              check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LIFL_TESTENV_CACHE": str(cache)}
    if source is not None:
        env["LIFL_SOURCE_ROOT"] = str(source)
    done = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if check and done.returncode != 0:
        pytest.fail(f"scripts/images.sh {' '.join(args)} failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    return done


def podman(*args: str, cache: Path = CACHE) -> str:
    return images_sh("podman", *args, cache=cache).stdout


def run_in(image: str, *command: str, cache: Path = CACHE) -> str:
    return podman("run", "--rm", "--network=none", image, *command, cache=cache).strip()


def image_config(image: str) -> dict[str, Any]:
    return json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image))


def snapshot(destination: Path) -> Path:
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(*SNAPSHOT_IGNORED), symlinks=True)
    return destination


def states(build_log: str) -> dict[str, str]:
    """What a build did with each image: {name: "building" | "up to date" | ...} from its log."""
    found: dict[str, str] = {}
    for line in build_log.splitlines():
        match = re.fullmatch(r"images: (building|up to date|skipping) +(\S+?):?(?: .*)?", line)
        if match:
            found[match[2]] = match[1]
    return found


def outputs(cache: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every archive, stamp and wheel: what a rebuild would replace."""
    images = cache / "images"
    files = [*images.glob("*.oci.tar"), *images.glob("*.stamp"), *(images / "wheelhouse").glob("*.whl")]
    return {str(f.relative_to(images)): (f.stat().st_ino, f.stat().st_mtime_ns) for f in files}


def listed(cache: Path = CACHE) -> dict[str, Path]:
    """scripts/images.sh list: {image name: archive}."""
    return {name: Path(archive) for name, archive in
            (line.split() for line in images_sh("list", cache=cache).stdout.splitlines())}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout as it is now: others may edit the working tree while the suite runs."""
    return snapshot(tmp_path_factory.mktemp("images") / "lifl")


@pytest.fixture(scope="module")
def first_build(source: Path) -> str:
    """Everything built (cached: only what changed since the last build); the build's log."""
    return images_sh("build", source=source).stderr


def test_every_image_is_built_and_listed(first_build: str) -> None:
    images = listed()
    for name in (BASE, NODE, FUNCTION, PAUSE):
        assert images[name].is_file(), f"{name} has no archive:\n{first_build}"
    assert states(first_build).get(NODE_BASE) in ("building", "up to date") and NODE_BASE not in images  # a stage only
    queue = [name for name in images if name.startswith("dev.local/knative/queue:")]
    if not (CACHE / "bin" / QUEUE_BINARY_NAME).exists():
        assert "skipping" in states(first_build).values(), first_build
    else:
        assert len(queue) == 1, images


def test_a_second_build_rebuilds_nothing(first_build: str, source: Path) -> None:
    before = outputs(CACHE)
    second = images_sh("build", source=source).stderr
    assert "building" not in second, second
    assert set(states(second).values()) <= {"up to date", "skipping"}, second
    assert outputs(CACHE) == before


def test_node_image_has_lifl_redis_bpftool_and_the_bpf_object(first_build: str) -> None:
    assert "usage" in run_in(NODE, "lifl", "--help").lower()
    assert run_in(NODE, "redis-server", "--version").startswith("Redis server v=")
    assert "bpftool v" in run_in(NODE, "bpftool", "version")
    assert run_in(NODE, "sh", "-c", "for c in kopf redis-cli; do command -v $c; done").splitlines() == [
        "/opt/lifl/venv/bin/kopf", "/usr/bin/redis-cli"]
    located = run_in(NODE, "sh", "-c", 'test -s "$LIFL_BPF_OBJECT" && python3 -c "from lifl.keys import ebpf; print(ebpf.OBJECT)"')
    assert located == "/opt/lifl/bpf/keychan.bpf.o"
    assert run_in(NODE, "id", "-u") == "0"  # the node agent needs root in its pod


def test_function_image_is_non_root_with_its_shim_handler_and_passed_tests(first_build: str) -> None:
    assert run_in(FUNCTION, "id", "-u") == "10001"
    assert run_in(FUNCTION, "id", "-g") == "10001"
    run_in(FUNCTION, "test", "-f", "/home/app/index.py", "-a", "-f", "/home/app/function/handler.py")
    assert run_in(FUNCTION, "python3", "-c", "import lifl.runtime, sys; print(sys.prefix)") == "/opt/lifl/venv"
    assert re.search(r"\d+ passed", run_in(FUNCTION, "cat", "/opt/lifl/function-tests.txt"))
    config = image_config(FUNCTION)
    assert config["User"] == "10001:10001"
    assert config["WorkingDir"] == "/home/app"
    assert config["Cmd"] == ["python3", "index.py"]
    assert "PORT=8080" in config["Env"]
    assert "8080/tcp" in config["ExposedPorts"]


HEALTH_PROBE = """
import os, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(f"http://127.0.0.1:{os.environ['PORT']}/_/health", timeout=5).status)
except urllib.error.HTTPError as refused:
    print(refused.code)
"""
SHIM_START_TIMEOUT_S = 60  # bounds a failure only


def test_function_image_starts_its_shim_on_port_8080(first_build: str) -> None:
    """Its CMD, as its user: the shim answers the health check, 503 until a node agent is there."""
    name = f"lifl-function-test-{os.getpid()}"
    podman("run", "-d", "--name", name, "--network=none", "-e", "LIFL_TENANT=acme", FUNCTION)
    try:
        deadline = time.monotonic() + SHIM_START_TIMEOUT_S
        while True:
            probe = images_sh("podman", "exec", name, "python3", "-c", HEALTH_PROBE, check=False)
            if probe.returncode == 0 and probe.stdout.strip():
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the shim did not answer on :8080:\n{podman('logs', name)}")
            time.sleep(0.2)
        assert probe.stdout.strip() == "503"
        processes = [line.split(None, 1) for line in podman("top", name, "user", "args").splitlines()[1:]]
        assert [[user, command.strip()] for user, command in processes] == [["10001", "python3 index.py"]]
    finally:
        podman("rm", "--force", "--time", "10", name)


def test_pause_image_runs_catatonit_in_pause_mode(first_build: str) -> None:
    assert image_config(PAUSE)["Entrypoint"] == ["/pause", "-P"]
    name = f"lifl-pause-test-{os.getpid()}"
    podman("run", "-d", "--name", name, "--network=none", PAUSE)
    try:
        assert podman("inspect", "--format", "{{.State.Status}}", name).strip() == "running"
    finally:
        podman("rm", "--force", "--time", "10", name)


def test_queue_image_runs_knative_queue_as_non_root(first_build: str) -> None:
    queue = [name for name in listed() if name.startswith("dev.local/knative/queue:")]
    if not queue:
        pytest.skip(f"no queue image: {CACHE / 'bin' / QUEUE_BINARY_NAME} is not built")
    config = image_config(queue[0])
    assert config["Entrypoint"] == ["/ko-app/queue"]
    assert config["User"] == "65532:65532"  # Knative runs it with runAsNonRoot and no runAsUser
    # it starts, and asks for the environment Knative gives it
    done = images_sh("podman", "run", "--rm", "--network=none", queue[0], check=False)
    assert done.returncode != 0 and "CONTAINER_CONCURRENCY" in done.stdout + done.stderr


def test_bad_arguments_are_named() -> None:
    done = images_sh("import", check=False)
    assert done.returncode != 0 and "import --address CONTAINERD_SOCKET" in done.stderr
    done = images_sh("import", "--address", "/nonexistent/containerd.sock", check=False)
    assert done.returncode != 0 and "/nonexistent/containerd.sock is not a socket" in done.stderr
    done = images_sh("import", "--address", check=False)
    assert done.returncode != 0 and "--address needs containerd's socket" in done.stderr
    done = images_sh("build", source=Path("/nonexistent"), check=False)
    assert done.returncode != 0 and "LIFL_SOURCE_ROOT must name a lifl source tree" in done.stderr
    done = images_sh("frobnicate", check=False)
    assert done.returncode != 0 and "usage:" in done.stderr


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[Path]:
    """A containerd of the test's own (its own root, state and socket; no CRI); yields its socket."""
    if shutil.which("containerd") is None:
        pytest.fail("containerd is not installed (Debian package containerd)")
    socket = tmp_path / "containerd.sock"
    config = tmp_path / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{tmp_path / "root"}"\nstate = "{tmp_path / "state"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{socket}"\n[ttrpc]\n  address = "{socket}.ttrpc"\n'
        '[debug]\n  address = ""\n[metrics]\n  address = ""\n')
    with open(tmp_path / "containerd.log", "wb") as log:
        daemon = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + CONTAINERD_START_TIMEOUT_S
        while subprocess.run(["ctr", "--address", str(socket), "version"], capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"containerd did not start:\n{(tmp_path / 'containerd.log').read_text()}")
            time.sleep(0.1)
        yield socket
    finally:
        daemon.terminate()
        daemon.wait(timeout=CONTAINERD_START_TIMEOUT_S)


def test_import_puts_every_built_image_into_containerd(first_build: str, containerd: Path) -> None:
    images_sh("import", "--address", str(containerd))
    names = subprocess.run(["ctr", "--address", str(containerd), "-n", "k8s.io", "images", "list", "--quiet"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert set(listed()) <= set(names)


@pytest.fixture
def seeded_cache(first_build: str) -> Iterator[Path]:
    """A cache of its own holding the usual cache's archives, stamps, wheelhouse and queue binary
    (hard links), with an empty podman store: only what a changed source needs is rebuilt in it."""
    cache = Path(tempfile.mkdtemp(prefix="lifl-images-cache-", dir=CACHE.parent))  # same file system: links
    usual = CACHE / "images"
    (cache / "images").mkdir()
    for kept in [*usual.glob("*.oci.tar"), *usual.glob("*.stamp")]:
        os.link(kept, cache / "images" / kept.name)
    shutil.copytree(usual / "wheelhouse", cache / "images" / "wheelhouse", copy_function=os.link)
    if (CACHE / "bin" / QUEUE_BINARY_NAME).exists():
        (cache / "bin").mkdir()
        os.link(CACHE / "bin" / QUEUE_BINARY_NAME, cache / "bin" / QUEUE_BINARY_NAME)
    try:
        yield cache
    finally:
        storage_conf = cache / "images" / "storage.conf"
        if storage_conf.exists():
            images_sh("podman", "rmi", "--all", "--force", cache=cache, check=False)
            run_root = re.search(r'^runroot = "(.+)"$', storage_conf.read_text(), re.M)
            if run_root:
                shutil.rmtree(Path(run_root[1]).parent, ignore_errors=True)
        shutil.rmtree(cache)


def test_a_changed_handler_rebuilds_only_the_lifl_images_and_its_tests_gate_the_function_alone(
        seeded_cache: Path, source: Path, tmp_path: Path) -> None:
    changed = shutil.copytree(source, tmp_path / "lifl", symlinks=True)  # what the first build built, changed below
    handler_test = changed / "functions" / "aggregator" / "handler_test.py"
    original_tests = handler_test.read_text()
    handler_test.write_text(original_tests + '\n\ndef test_gate() -> None:\n'
                                             '    assert False, "a failing function test stops the build"\n')
    before = outputs(seeded_cache)
    failed = images_sh("build", source=changed, cache=seeded_cache, check=False)
    assert failed.returncode != 0
    assert "a failing function test stops the build" in failed.stderr
    gated = states(failed.stderr)
    assert gated[FUNCTION] == "building"
    assert gated["wheelhouse"] == gated[NODE] == "up to date"  # the tests are not in the wheel
    after = outputs(seeded_cache)
    assert after["aggregator.stamp"] == before["aggregator.stamp"]
    assert after["aggregator.oci.tar"] == before["aggregator.oci.tar"]

    handler_test.write_text(original_tests)
    handler = changed / "functions" / "aggregator" / "handler.py"
    handler.write_text(handler.read_text() + "\n# edited by tests/test_images.py\n")
    rebuilt = images_sh("build", source=changed, cache=seeded_cache).stderr
    done = states(rebuilt)
    assert done.pop("wheelhouse") == "building"
    assert done.pop(NODE) == "building"
    assert done.pop(NODE_BASE) == "up to date"  # the node's apt packages: not installed again
    assert done.pop(FUNCTION) == "building"
    assert set(done.values()) <= {"up to date", "skipping"}, rebuilt
    assert BASE in done and PAUSE in done
    edited = run_in(FUNCTION, "tail", "-n", "1", "/home/app/function/handler.py", cache=seeded_cache)
    assert edited == "# edited by tests/test_images.py"
