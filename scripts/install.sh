#!/usr/bin/env bash
# Install everything lifl needs on Debian/Ubuntu: system packages, then the Python environment
# in .venv (lifl installed in editable mode, with its C kernels built). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(redis-server gcc libc6-dev python3-dev python3-venv iproute2 procps
          make clang bpftool libbpf-dev  # build and load the eBPF key channel (bpf/)
          etcd-server openssl  # the Kubernetes test bed's store and certificates (scripts/k8s-testenv.sh)
          containerd runc containernetworking-plugins  # its real node: CRI runtime, OCI runtime, CNI bridge (iptables comes with it, for hostPorts)
          podman mmdebstrap catatonit)  # lifl's images (scripts/images.sh): builder, Debian base, the pause image's init
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# h2spec, the HTTP/2 conformance suite the tests run against the gRPC port, is built with Go 1.18+
go_suffices() {
  command -v go >/dev/null || return 1
  local version
  version="$(go env GOVERSION)"  # e.g. go1.22.2
  version="${version#go}"
  local major="${version%%.*}" rest="${version#*.}"
  local minor="${rest%%[!0-9]*}"  # go1.22.2, go1.23rc1
  [[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] && ((major > 1 || minor >= 18))
}
go_suffices || missing+=(golang-go)
if ((${#missing[@]})); then
  echo "lifl: installing system packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "lifl needs Python 3.11 or newer ($python is $("$python" --version 2>&1))"; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.lifl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ lifl/kernels.c -nt "$stamp" ]; then
  # quiet unless it fails (setuptools' deprecation notices are not ours to act on)
  if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e '.[dev,fl]'; } >.venv/install.log 2>&1; then
    cat .venv/install.log
    echo "lifl: installing the Python environment failed (log above, also in .venv/install.log)"
    exit 1
  fi
  touch "$stamp"
fi
# The eBPF key channel's object, compiled against this kernel's BTF (make rebuilds only what changed).
if [ -r /sys/kernel/btf/vmlinux ]; then
  make -s -C bpf
else
  echo "lifl: this kernel exposes no BTF (/sys/kernel/btf/vmlinux): the eBPF key channel is not built"
fi
go_suffices || { echo "lifl: building h2spec needs Go 1.18 or newer (found: $(go version 2>&1 || true))"; exit 1; }
scripts/h2spec/build.sh
echo "lifl: installed (.venv/bin/lifl)"
