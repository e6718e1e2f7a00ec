#!/usr/bin/env bash
# lifl's container images, built on this machine from this checkout: no registry, no pulls.
#
#   scripts/images.sh build                     build what changed (cached); one line per image and its state
#   scripts/images.sh import --address SOCKET   import every built image into containerd (namespace k8s.io)
#   scripts/images.sh list                      the built images: name and OCI archive, one a line
#   scripts/images.sh podman ARGS…              podman on the images' own store (e.g. `podman run --rm IMAGE …`)
#
# The images: dev.local/lifl/base:bookworm (Debian minbase + Python, made by mmdebstrap from the
# mirror the host's apt uses), dev.local/lifl/lifl:VERSION (the node: lifl[k8s] in a venv,
# redis-server, bpftool, the eBPF object; templates/lifl-node, on dev.local/lifl/node-base:bookworm,
# which holds the apt packages and is rebuilt only when they change), dev.local/lifl/aggregator:VERSION
# (the aggregator function, OpenFaaS-style, non-root, built only if its tests pass;
# templates/lifl-aggregator + functions/aggregator), dev.local/knative/queue:KNATIVE_VERSION
# (Knative's queue-proxy, from the binary scripts/k8s-testenv.sh builds) and
# dev.local/lifl/pause:3.10 (containerd's sandbox image: Debian's static catatonit).
# Python packages come from a wheelhouse built on the host by Debian's own python3 (the images'
# Python), so images install them without network.
#
# Each image is saved as an OCI archive beside a stamp, the sha256 of everything it was built
# from (its build context, its recipe, its base's stamp): an image whose stamp matches is not
# rebuilt. Podman keeps its own store and configuration in the cache, with this machine's
# workarounds (runc, cgroupfs, explicit nofile and nproc limits); /etc is left alone.
#
# Needs root and Debian's podman, runc, mmdebstrap, catatonit, and containerd's ctr for `import`.
# LIFL_TESTENV_CACHE (default ~/.cache/lifl-testenv) holds everything under images/;
# LIFL_SOURCE_ROOT (default this checkout) is the lifl source tree the lifl images are built from.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(…) fails the assignment it feeds, as it would outside

REPO="$(cd "$(dirname "$0")/.." && pwd)"
SOURCE="${LIFL_SOURCE_ROOT:-$REPO}"
CACHE="${LIFL_TESTENV_CACHE:-$HOME/.cache/lifl-testenv}"
OUT="$CACHE/images"
WHEEL_PYTHON=/usr/bin/python3  # Debian's: the same Python as the images'
DEBIAN_SUITE=bookworm
QUEUE_BINARY="$CACHE/bin/knative-queue"
PAUSE_BINARY=/usr/bin/catatonit  # static: it is all the pause image holds

say() { echo "images: $*" >&2; }
die() { say "$*"; exit 1; }

need_command() {  # command, the Debian package that has it
  command -v "$1" >/dev/null || die "$1 is not installed (Debian package $2)"
}

lifl_version() {
  local version
  [ -f "$SOURCE/pyproject.toml" ] || die "$SOURCE has no pyproject.toml: LIFL_SOURCE_ROOT must name a lifl source tree"
  version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$SOURCE/pyproject.toml")"
  [ -n "$version" ] || die "no version = \"…\" line in $SOURCE/pyproject.toml"
  echo "$version"
}

knative_version() {  # the serving module the test bed builds its Knative binaries from
  local version
  version="$(awk '$1 == "knative.dev/serving" { print $2; exit }' "$REPO/scripts/k8s/knative/go.mod")"
  [ -n "$version" ] || die "no knative.dev/serving requirement in $REPO/scripts/k8s/knative/go.mod"
  echo "$version"
}

BASE_IMAGE="dev.local/lifl/base:$DEBIAN_SUITE"
IMAGES=(base lifl aggregator queue pause)  # in build order; each has its archive and stamp under $OUT
# node-base (templates/lifl-node/base.Containerfile) is built and cached the same way, but only as
# the node image's base: it is not listed or imported

image_name() {  # key
  local version
  case "$1" in
    base) echo "$BASE_IMAGE" ;;
    node-base) echo "dev.local/lifl/node-base:$DEBIAN_SUITE" ;;
    lifl | aggregator) version="$(lifl_version)"; echo "dev.local/lifl/$1:$version" ;;
    queue) version="$(knative_version)"; echo "dev.local/knative/queue:$version" ;;
    pause) echo "dev.local/lifl/pause:3.10" ;;
  esac
}

# -- podman, configured for this machine -----------------------------------------------------------
# Hybrid cgroups, no systemd as PID 1 and no CAP_SYS_RESOURCE: crun refuses the cgroups, the
# systemd cgroup manager has no systemd to talk to, and a rootful container's nofile and nproc
# default to 1048576, above what root may raise them to here ("error setting rlimit type 6:
# operation not permitted"). So containers get this shell's hard limits, nproc no more than
# kernel.pid_max: podman lowers its own nproc to that before it starts the runtime.
hard_limit() {  # ulimit flag: as podman writes it (-1 is unlimited)
  local limit
  limit="$(ulimit -H "$1")"
  [ "$limit" = unlimited ] && echo -1 || echo "$limit"
}

process_limit() {
  local limit pid_max
  limit="$(hard_limit -u)"
  pid_max="$(cat /proc/sys/kernel/pid_max)"
  if [ "$limit" = -1 ] || [ "$limit" -gt "$pid_max" ]; then limit="$pid_max"; fi
  echo "$limit"
}

configure_podman() {
  local run_root nofile nproc
  # podman expects its run root to be emptied on boot, as /run usually is
  run_root="/run/lifl-images/$(printf '%s' "$OUT" | sha256sum | cut -c1-16)"
  nofile="$(hard_limit -n)"
  nproc="$(process_limit)"
  mkdir -p "$OUT/storage" "$run_root"
  cat > "$OUT/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$run_root/libpod"
EOF
  cat > "$OUT/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$OUT/storage"
runroot = "$run_root/storage"
EOF
  export CONTAINERS_CONF="$OUT/containers.conf" CONTAINERS_STORAGE_CONF="$OUT/storage.conf"
}

# -- stamps ----------------------------------------------------------------------------------------
tree_digest() {  # directory: sha256 over every file's path and content
  (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum) \
    | sha256sum | cut -d' ' -f1
}

recipe_digest() {  # function names...: the code that builds an image is part of what it is built from
  declare -f "$@" | sha256sum | cut -d' ' -f1
}

stamp_of() { cat "$OUT/$1.stamp" 2>/dev/null || true; }

copy_tree() {  # from, to, paths...: sources without what running them left behind
  local from="$1" to="$2"
  shift 2
  mkdir -p "$to"
  tar -C "$from" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.so' --exclude='*.egg-info' -cf - "$@" | tar -C "$to" -xf -
}

context_dir() {  # key: a fresh, empty build context
  rm -rf "$OUT/context/$1"
  mkdir -p "$OUT/context/$1"
  echo "$OUT/context/$1"
}

# -- images ----------------------------------------------------------------------------------------
# ensure_image key stamp builder [context]: build unless the stamp matches; an image whose
# archive is current but which the store lost (a fresh store, a pruned one) is loaded back.
ensure_image() {
  local key="$1" stamp="$2" builder="$3" context="${4:-}"
  local archive="$OUT/$key.oci.tar" name
  name="$(image_name "$key")"
  if [ "$(stamp_of "$key")" = "$stamp" ] && [ -f "$archive" ]; then
    if ! podman image exists "$name"; then
      say "loading   $name from $archive"
      podman load -q -i "$archive" >/dev/null
      podman image exists "$name" || die "$archive does not hold $name"
    fi
    say "up to date $name"
    return 0
  fi
  say "building  $name"
  local started=$SECONDS
  "$builder" "$name" "$context"
  rm -f "$archive.partial"
  podman save -q --format oci-archive -o "$archive.partial" "$name"
  mv "$archive.partial" "$archive"
  echo "$stamp" > "$OUT/$key.stamp"
  say "built     $name in $((SECONDS - started)) s ($(du -m "$archive" | cut -f1) MB archive)"
}

podman_build() {  # name, context, containerfile, network, extra build flags...
  local name="$1" context="$2" containerfile="$3" network="$4"
  shift 4
  # --pull=never: every FROM is one of ours or scratch; a missing base is an error, not a download
  podman build -q --pull=never --network="$network" --layers --force-rm -f "$context/$containerfile" -t "$name" "$@" \
    "$context" >/dev/null
}

apt_sources() {  # the host's enabled Debian sources for the image's suite, as one-line entries
  # shellcheck disable=SC2016  # apt's format fields, not shell expansions
  apt-get indextargets --no-release-info --format '$(REPO_URI) $(RELEASE) $(COMPONENT) $(TARGET_OF)' 'Created-By: Packages' \
    | awk -v suite="$DEBIAN_SUITE" '$3 == "main" && $4 == "deb" && ($2 == suite || $2 ~ "^" suite "-(updates|security)$") {
        print "deb " $1 " " $2 " main" }' | LC_ALL=C sort -u
}

build_base() {  # name
  local sources tarball
  sources="$(apt_sources)"
  grep -q " $DEBIAN_SUITE main$" <<<"$sources" \
    || die "the host's apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d/) name no Debian mirror for $DEBIAN_SUITE main"
  tarball="$(context_dir base)/rootfs.tar"
  local mirrors=()
  mapfile -t mirrors <<<"$sources"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates "$DEBIAN_SUITE" "$tarball" "${mirrors[@]}"
  podman import -q "$tarball" "$1" >/dev/null
  rm -rf "$OUT/context/base"
}

base_stamp() {
  printf '%s\n' "$(recipe_digest build_base apt_sources)" "$(apt_sources)" | sha256sum | cut -d' ' -f1
}

# The Python sources of the lifl distribution (pyproject.toml's package-dir); copied, not built in
# place: the working tree is shared, and a wheel build writes build/ and *.egg-info into it.
LIFL_DISTRIBUTION=(pyproject.toml setup.py lifl gateway functions autoscaler)

python_version_of() {  # python command...: its full version (environment markers compare it: redis needs
  "$@" -c 'import platform; print(platform.python_version())'  # async-timeout below 3.11.3)
}

# lifl[k8s], its dependencies and pytest as wheels in $OUT/wheelhouse, resolved by the very Python
# the images run: Debian's, from a venv of the host's /usr/bin/python3 (.venv may be another
# Python, whose environment markers would pick other dependencies).
build_wheelhouse() {
  local source="$OUT/context/wheelhouse-source" venv="$OUT/wheel-venv"
  local host_python image_python stamp
  host_python="$(python_version_of "$WHEEL_PYTHON")"
  image_python="$(python_version_of podman run --rm --network=none "$BASE_IMAGE" python3)"
  [ "$host_python" = "$image_python" ] \
    || die "$WHEEL_PYTHON is Python $host_python but $BASE_IMAGE has $image_python: the wheels must be resolved by the image's Python (update the host's python3 or rebuild the base)"
  rm -rf "$source"
  copy_tree "$SOURCE" "$source" "${LIFL_DISTRIBUTION[@]}"
  # a function's tests run in its own image's build, from its context: the wheel (and the node
  # image) does without them, so a change to them rebuilds the function image alone
  find "$source" -name '*_test.py' -delete
  stamp="$(printf '%s\n' "$(recipe_digest build_wheelhouse)" "$host_python" "$(tree_digest "$source")" | sha256sum | cut -d' ' -f1)"
  if [ "$(stamp_of wheelhouse)" = "$stamp" ] && [ -d "$OUT/wheelhouse" ]; then
    say "up to date wheelhouse"
    return 0
  fi
  say "building  wheelhouse"
  if [ "$(python_version_of "$venv/bin/python" 2>/dev/null)" != "$host_python" ]; then
    rm -rf "$venv"
    "$WHEEL_PYTHON" -m venv "$venv" || die "$WHEEL_PYTHON cannot make a venv (Debian package python3-venv)"
  fi
  rm -rf "$OUT/wheelhouse.partial"
  # quiet unless it fails: setuptools' notices about lifl's packaging are not this build's to act on
  if ! "$venv/bin/pip" wheel --wheel-dir "$OUT/wheelhouse.partial" "${source}[k8s]" 'pytest>=8' >"$OUT/wheelhouse.log" 2>&1; then
    cat "$OUT/wheelhouse.log" >&2
    die "building the wheelhouse failed (log above, also in $OUT/wheelhouse.log)"
  fi
  rm -rf "$OUT/wheelhouse" "$source"
  mv "$OUT/wheelhouse.partial" "$OUT/wheelhouse"
  echo "$stamp" > "$OUT/wheelhouse.stamp"
}

build_node_base() {  # name, context; apt-get install needs the mirror: the host's network
  podman_build "$1" "$2" base.Containerfile host
}

build_node() {  # name, context
  podman_build "$1" "$2" Containerfile none
}

node_base_context() {
  local context
  context="$(context_dir node-base)"
  copy_tree "$SOURCE/templates/lifl-node" "$context" base.Containerfile
  echo "$context"
}

build_function() {  # name, context; Python packages come from the wheelhouse only: no network
  podman_build "$1" "$2" Dockerfile none
}

node_context() {
  local context bpf_object="$SOURCE/bpf/keychan.bpf.o"
  [ -f "$bpf_object" ] || die "$bpf_object is missing: run make bpf"
  context="$(context_dir node)"
  copy_tree "$SOURCE/templates/lifl-node" "$context" .
  cp -al "$OUT/wheelhouse" "$context/wheelhouse"
  cp "$bpf_object" "$context/keychan.bpf.o"
  echo "$context"
}

# As faas-cli assembles it: the template's files at the root, the handler in function/.
function_context() {
  local context template="$SOURCE/templates/lifl-aggregator" handler="$SOURCE/functions/aggregator"
  local required
  for required in "$template/Dockerfile" "$template/index.py" "$handler/handler.py"; do
    [ -f "$required" ] || die "$required is missing: the aggregator's build context needs it"
  done
  context="$(context_dir aggregator)"
  copy_tree "$template" "$context" .
  copy_tree "$handler" "$context/function" .
  cp -al "$OUT/wheelhouse" "$context/wheelhouse"
  echo "$context"
}

build_queue() {  # name, context
  cat > "$2/Containerfile" <<EOF
FROM $BASE_IMAGE
COPY queue /ko-app/queue
# Knative runs queue-proxy with runAsNonRoot and no runAsUser: the image names a numeric non-root
# user, as ko's distroless base does
USER 65532:65532
ENTRYPOINT ["/ko-app/queue"]
EOF
  podman_build "$1" "$2" Containerfile none
}

queue_context() {
  local context
  context="$(context_dir queue)"
  cp "$QUEUE_BINARY" "$context/queue"
  echo "$context"
}

build_pause() {  # name, context
  cat > "$2/Containerfile" <<'EOF'
FROM scratch
COPY pause /pause
ENTRYPOINT ["/pause", "-P"]
EOF
  podman_build "$1" "$2" Containerfile none
}

pause_context() {
  local context
  context="$(context_dir pause)"
  cp "$PAUSE_BINARY" "$context/pause"
  echo "$context"
}

# stamp of a context-built image: its recipe, its base's stamp, its context
context_stamp() {  # base stamp, context, recipe functions...
  local base="$1" context="$2"
  shift 2
  printf '%s\n' "$(recipe_digest "$@" podman_build)" "$base" "$(tree_digest "$context")" | sha256sum | cut -d' ' -f1
}

build() {
  [ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap and podman's store)"
  need_command podman podman
  need_command runc runc
  need_command mmdebstrap mmdebstrap
  need_command flock util-linux
  [ -x "$PAUSE_BINARY" ] || die "$PAUSE_BINARY is missing (Debian package catatonit)"
  lifl_version >/dev/null  # LIFL_SOURCE_ROOT names a lifl source tree, or the build stops here
  mkdir -p "$OUT"
  # one build at a time per cache (the test bed builds too): they share contexts, store and stamps
  exec {lock}>"$OUT/build.lock"
  flock -n "$lock" || { say "waiting for another build in $OUT"; flock "$lock"; }
  configure_podman

  local base context stamp
  base="$(base_stamp)"
  ensure_image base "$base" build_base

  context="$(node_base_context)"
  local node_base
  node_base="$(context_stamp "$base" "$context" build_node_base node_base_context)"
  ensure_image node-base "$node_base" build_node_base "$context"

  build_wheelhouse
  context="$(node_context)"
  stamp="$(context_stamp "$node_base" "$context" build_node node_context)"
  ensure_image lifl "$stamp" build_node "$context"
  context="$(function_context)"
  stamp="$(context_stamp "$base" "$context" build_function function_context)"
  ensure_image aggregator "$stamp" build_function "$context"

  if [ -x "$QUEUE_BINARY" ]; then
    context="$(queue_context)"
    stamp="$(context_stamp "$base" "$context" build_queue queue_context)"
    ensure_image queue "$stamp" build_queue "$context"
  else
    say "skipping  $(image_name queue): $QUEUE_BINARY is missing (scripts/k8s-testenv.sh build builds it)"
  fi
  context="$(pause_context)"
  stamp="$(context_stamp "" "$context" build_pause pause_context)"  # FROM scratch: no base
  ensure_image pause "$stamp" build_pause "$context"

  rm -rf "$OUT/context"
  podman image prune -f >/dev/null  # the images the rebuilt tags replaced
}

# -- list, import ----------------------------------------------------------------------------------
built_images() {  # "name archive" for every image with an archive and a stamp
  local key name
  for key in "${IMAGES[@]}"; do
    name="$(image_name "$key")"
    if [ -f "$OUT/$key.oci.tar" ] && [ -f "$OUT/$key.stamp" ]; then
      echo "$name $OUT/$key.oci.tar"
    else
      say "not built: $name (scripts/images.sh build)"
    fi
  done
}

import() {  # --address SOCKET
  local address=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --address) [ $# -ge 2 ] || die "--address needs containerd's socket"; address="$2"; shift 2 ;;
      --address=*) address="${1#--address=}"; shift ;;
      *) die "import: unknown argument $1 (usage: $0 import --address CONTAINERD_SOCKET)" ;;
    esac
  done
  [ -n "$address" ] || die "usage: $0 import --address CONTAINERD_SOCKET"
  [ -S "$address" ] || die "$address is not a socket (is containerd running?)"
  need_command ctr containerd
  local images name archive
  images="$(built_images)"
  [ -n "$images" ] || die "no image is built: run $0 build first"
  while read -r name archive; do
    say "importing $name"
    ctr --address "$address" -n k8s.io images import "$archive" >/dev/null </dev/null
  done <<<"$images"
}

case "${1:-}" in
  build) build ;;
  import) shift; import "$@" ;;
  list) built_images ;;
  podman)
    shift
    [ "$(id -u)" -eq 0 ] || die "needs root (the images' store is root's)"
    mkdir -p "$OUT"
    configure_podman
    exec podman "$@"
    ;;
  *) die "usage: $0 build | import --address CONTAINERD_SOCKET | list | podman ARGS…" ;;
esac
