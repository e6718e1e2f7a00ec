#!/usr/bin/env bash
# Build h2spec, the HTTP/2 conformance suite tests/test_h2spec.py runs against the gateway's
# gRPC port, from the module pinned here into .venv/bin/h2spec (or the path given). Skipped
# while the binary is newer than go.sum. Needs Go 1.18 or newer (scripts/install.sh installs it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../../.venv/bin/h2spec}"
if [ -x "$out" ] && [ "$out" -nt "$here/go.sum" ]; then
  exit 0
fi
command -v go >/dev/null || { echo "h2spec: Go is not installed (scripts/install.sh installs it)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
cd "$here"
# go.sum pins every module: no checksum database is needed, and no other toolchain is fetched
GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" go build -o "$out.tmp" github.com/summerwind/h2spec/cmd/h2spec
mv "$out.tmp" "$out"
echo "h2spec: built $out"
