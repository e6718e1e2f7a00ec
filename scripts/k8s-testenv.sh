#!/usr/bin/env bash
# lifl's Kubernetes test bed: a real control plane with real Knative Serving on this machine.
#
#   scripts/k8s-testenv.sh up          build what is missing (cached), start everything; prints the kubeconfig's path last
#   scripts/k8s-testenv.sh exec CMD…   run CMD inside the test bed (KUBECONFIG set, its kubectl first on PATH)
#   scripts/k8s-testenv.sh down        stop and remove everything `up` started
#   scripts/k8s-testenv.sh build       only build (or check) the binaries
#
# Everything runs inside a network namespace that holds only loopback, so nothing a test starts
# can send a packet off the machine: etcd (Debian's etcd-server), kube-apiserver, -scheduler and
# -controller-manager and kubectl (built from k8s.io/kubernetes, scripts/k8s/kube), kwok
# simulating nodes and the pods on them (scripts/k8s/kwok), and Knative Serving's controller,
# webhook and autoscaler as processes (scripts/k8s/knative), with the CRDs and ConfigMaps of that
# same module. The pod and service ranges are routed to loopback, so a pod's or a Service's IP
# reaches whatever listens on it inside the namespace. No Knative networking layer can be
# obtained here: KIngresses stay unready unless something marks them (tests/k8s/ does).
#
# Needs root (network namespaces), Go 1.24+, etcd-server and openssl (scripts/install.sh installs them).
# LIFL_TESTENV_CACHE (default ~/.cache/lifl-testenv) keeps the binaries; LIFL_TESTENV_DIR
# (default /run/lifl-testenv) the running bed's state and logs; LIFL_TESTENV_NODES fake nodes (3).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${LIFL_TESTENV_CACHE:-$HOME/.cache/lifl-testenv}"
STATE="${LIFL_TESTENV_DIR:-/run/lifl-testenv}"
NETNS="${LIFL_TESTENV_NETNS:-lifl-testenv}"
NODES="${LIFL_TESTENV_NODES:-3}"
BIN="$CACHE/bin"
K8S_VERSION=v1.32.4
ADDR=10.200.0.1           # the API server's address: an alias on the namespace's loopback
POD_CIDR=10.244.0.0/16    # kwok's pod IPs
SERVICE_CIDR=10.96.0.0/16
KUBECONFIG_PATH="$STATE/kubeconfig"
START_TIMEOUT_S=180

say() { echo "k8s-testenv: $*" >&2; }
die() { say "$*"; exit 1; }

in_netns() { ip netns exec "$NETNS" "$@"; }

# -- build ---------------------------------------------------------------------------------------
stamp_of() {  # what a build depends on: the module files and this script's build steps
  cat "$ROOT"/scripts/k8s/*/go.mod "$ROOT"/scripts/k8s/*/go.sum <(sed -n '/^# -- build/,/^# -- end of build/p' "$0") | sha256sum | cut -d' ' -f1
}

go_build() {  # module dir, output name, package, extra flags...
  local module="$1" out="$2" package="$3"
  shift 3
  (cd "$ROOT/scripts/k8s/$module" && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go build -trimpath -o "$BIN/$out" "$@" "$package")
}

build() {
  local stamp
  stamp="$(stamp_of)"
  if [ -f "$CACHE/stamp" ] && [ "$(cat "$CACHE/stamp")" = "$stamp" ]; then
    return 0
  fi
  command -v go >/dev/null || die "building the test bed needs Go 1.24 or newer"
  say "building the control plane, kwok and Knative Serving from Go modules (first time: about 15 minutes)"
  mkdir -p "$BIN"
  local v=k8s.io/component-base/version
  local kube_ldflags="-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=32 -X $v.gitTreeState=clean"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    go_build kube "$cmd" "k8s.io/kubernetes/cmd/$cmd" -ldflags "$kube_ldflags"
  done
  go_build kwok kwok sigs.k8s.io/kwok/cmd/kwok -ldflags "-s -w"
  for cmd in controller webhook autoscaler; do
    go_build knative "knative-$cmd" "knative.dev/serving/cmd/$cmd" -ldflags "-s -w"
  done
  # Knative's CRDs and ConfigMaps, from the very modules its binaries were built from
  local serving networking caching
  serving="$(cd "$ROOT/scripts/k8s/knative" && go list -m -f '{{.Dir}}' knative.dev/serving)"
  networking="$(cd "$ROOT/scripts/k8s/knative" && go list -m -f '{{.Dir}}' knative.dev/networking)"
  caching="$(cd "$ROOT/scripts/k8s/knative" && go list -m -f '{{.Dir}}' knative.dev/caching)"
  rm -rf "$CACHE/knative" && mkdir -p "$CACHE/knative/crds" "$CACHE/knative/config"
  cp "$serving"/config/core/300-resources/*.yaml "$networking"/config/{certificate,domain-claim,ingress,serverlessservice}.yaml \
     "$caching"/config/image.yaml "$CACHE/knative/crds/"
  cp "$serving"/config/core/configmaps/*.yaml "$networking"/config/config-network.yaml "$serving"/config/core/webhooks/*.yaml \
     "$CACHE/knative/config/"
  chmod -R u+w "$CACHE/knative"
  echo "$stamp" > "$CACHE/stamp"
}
# -- end of build --------------------------------------------------------------------------------

need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (it makes a network namespace)"; }

ensure_etcd() {
  command -v etcd >/dev/null || die "etcd is not installed (Debian's etcd-server; scripts/install.sh installs it)"
}

start() {  # name, command...: a daemon inside the namespace, logged and remembered
  local name="$1"
  shift
  in_netns setsid "$@" >"$STATE/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$STATE/pids/$name"
}

wait_for() {  # description, command...
  local what="$1" deadline=$((SECONDS + START_TIMEOUT_S))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "timed out waiting for $what (logs in $STATE/logs)"
    sleep 0.5
  done
}

nonempty() { [ -n "$("$@" 2>/dev/null)" ]; }

kubectl_() { in_netns env KUBECONFIG="$KUBECONFIG_PATH" "$BIN/kubectl" "$@"; }

certificates() {
  local d="$STATE/pki"
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=lifl-testenv-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  sign() {  # name, subject, extensions
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
    openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 \
      -extfile <(printf '%s\n' "$3") -out "$d/$1.crt" 2>/dev/null
  }
  sign apiserver "/CN=kube-apiserver" \
    "subjectAltName=IP:$ADDR,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=lifl-testenv-admin" "extendedKeyUsage=clientAuth"
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  cat > "$KUBECONFIG_PATH" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: lifl-testenv
  cluster: {server: "https://$ADDR:6443", certificate-authority: "$d/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$d/admin.crt", client-key: "$d/admin.key"}
contexts:
- name: lifl-testenv
  context: {cluster: lifl-testenv, user: admin}
current-context: lifl-testenv
EOF
}

fake_nodes() {
  local i
  for ((i = 1; i <= NODES; i++)); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok$i
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {type: kwok, kubernetes.io/hostname: kwok$i, kubernetes.io/os: linux, kubernetes.io/arch: amd64}
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
  nodeInfo: {kubeletVersion: fake, operatingSystem: linux, architecture: amd64}
  phase: Running
EOF
  done
}

knative_system() {  # what Knative's processes expect to find in-cluster
  cat <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: knative-serving}
---
# The activator is not run (lifl's class never routes through it; stock KPA is given direct
# endpoints), but the ServerlessService reconciler needs its Service and Endpoints.
apiVersion: v1
kind: Service
metadata: {name: activator-service, namespace: knative-serving, labels: {app: activator}}
spec:
  ports:
  - {name: http-metrics, port: 9090, targetPort: 9090}
  - {name: http, port: 80, targetPort: 8012}
  - {name: http2, port: 81, targetPort: 8013}
---
apiVersion: v1
kind: Endpoints
metadata: {name: activator-service, namespace: knative-serving, labels: {app: activator}}
subsets:
- addresses: [{ip: "$ADDR"}]
  ports:
  - {name: http-metrics, port: 9090}
  - {name: http, port: 8012}
  - {name: http2, port: 8013}
---
# The webhook runs as a process listening on :443 in the namespace; this Service's ClusterIP
# is routed to loopback, which is how the API server reaches it.
apiVersion: v1
kind: Service
metadata: {name: webhook, namespace: knative-serving, labels: {app: webhook}}
spec:
  ports: [{name: https-webhook, port: 443, targetPort: 443}]
EOF
}

knative_env() {  # name, metrics port
  echo SYSTEM_NAMESPACE=knative-serving METRICS_DOMAIN=knative.dev/internal/serving POD_NAME="$1" POD_IP="$ADDR" \
    METRICS_PROMETHEUS_PORT="$2" PROFILING_PORT="$(($2 + 100))" KUBECONFIG="$KUBECONFIG_PATH"
}

up() {
  need_root
  build
  ensure_etcd
  if ip netns list | grep -qw "$NETNS"; then
    die "already up (scripts/k8s-testenv.sh down first); kubeconfig: $KUBECONFIG_PATH"
  fi
  rm -rf "$STATE"
  mkdir -p "$STATE/logs" "$STATE/pids" "$STATE/etcd"
  chmod 0700 "$STATE"
  ip netns add "$NETNS"
  in_netns ip link set lo up
  in_netns ip addr add "$ADDR/32" dev lo
  in_netns ip route replace local "$POD_CIDR" dev lo
  in_netns ip route replace local "$SERVICE_CIDR" dev lo
  certificates
  local pki="$STATE/pki"

  start etcd etcd --name lifl-testenv --data-dir "$STATE/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster lifl-testenv=http://127.0.0.1:2380 --quota-backend-bytes 2147483648
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --advertise-address="$ADDR" --bind-address=0.0.0.0 --secure-port=6443 \
    --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
    --client-ca-file="$pki/ca.crt" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" --authorization-mode=Node,RBAC \
    --feature-gates=WatchList=false --enable-priority-and-fairness=false --profiling=false
  wait_for "the API server" kubectl_ get --raw /readyz
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$KUBECONFIG_PATH" \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=10257 --profiling=false
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$KUBECONFIG_PATH" --leader-elect=false \
    --bind-address=127.0.0.1 --secure-port=10259 --profiling=false
  start kwok "$BIN/kwok" --kubeconfig="$KUBECONFIG_PATH" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr="${POD_CIDR%.0/16}.1/16" --node-ip="$ADDR" --node-port=10247 --server-address=127.0.0.1:10247 \
    --node-lease-duration-seconds=40  # kwok renews the nodes' leases: without them a node goes NotReady (and its pods unready) after 40 s
  wait_for "the default service account" kubectl_ get serviceaccount default
  fake_nodes | kubectl_ apply -f - >/dev/null

  # Knative Serving: CRDs, its namespace and the Services its processes expect, its ConfigMaps
  kubectl_ apply --server-side -f "$CACHE/knative/crds" >/dev/null
  knative_system | kubectl_ apply -f - >/dev/null
  wait_for "Knative's CRDs" kubectl_ wait --for=condition=Established --timeout=5s crd --all
  kubectl_ apply --server-side --field-manager=lifl-testenv -f "$CACHE/knative/config" >/dev/null
  # images are never resolved to digests (nothing can be pulled here), and there is no queue image
  kubectl_ patch configmap config-deployment -n knative-serving --type merge \
    -p '{"data": {"queue-sidecar-image": "dev.local/knative/queue:v0.42.2", "registries-skipping-tag-resolving": "kind.local,ko.local,dev.local"}}' >/dev/null
  # shellcheck disable=SC2046
  start knative-webhook env $(knative_env webhook 9192) WEBHOOK_NAME=webhook WEBHOOK_PORT=443 "$BIN/knative-webhook"
  # shellcheck disable=SC2046
  start knative-controller env $(knative_env controller 9190) "$BIN/knative-controller"
  # shellcheck disable=SC2046
  start knative-autoscaler env $(knative_env autoscaler 9191) "$BIN/knative-autoscaler"
  wait_for "Knative's webhook" nonempty kubectl_ get mutatingwebhookconfiguration webhook.serving.knative.dev \
    -o 'jsonpath={.webhooks[0].clientConfig.caBundle}'
  wait_for "Knative's autoscaler to lead its bucket" nonempty kubectl_ get lease autoscaler-bucket-00-of-01 \
    -n knative-serving -o 'jsonpath={.spec.holderIdentity}'
  wait_for "the kwok nodes" kubectl_ wait --for=condition=Ready --timeout=5s node --all
  say "up: $NODES kwok nodes, Knative Serving v0.42.2 (logs in $STATE/logs)"
  echo "$KUBECONFIG_PATH"
}

down() {
  need_root
  local pidfile
  if [ -d "$STATE/pids" ]; then
    for pidfile in "$STATE"/pids/*; do
      [ -e "$pidfile" ] || continue
      kill -TERM -- "-$(cat "$pidfile")" 2>/dev/null || kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 1
    for pidfile in "$STATE"/pids/*; do
      [ -e "$pidfile" ] || continue
      kill -KILL -- "-$(cat "$pidfile")" 2>/dev/null || true
    done
  fi
  if ip netns list | grep -qw "$NETNS"; then
    # whatever a test started in the namespace goes with it
    ip netns pids "$NETNS" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns delete "$NETNS"
  fi
  rm -rf "$STATE"
  say "down"
}

case "${1:-}" in
  build) build ;;
  up) up ;;
  down) down ;;
  exec)
    shift
    [ $# -gt 0 ] || die "exec needs a command"
    [ -f "$KUBECONFIG_PATH" ] || die "not up (scripts/k8s-testenv.sh up)"
    exec ip netns exec "$NETNS" env KUBECONFIG="$KUBECONFIG_PATH" PATH="$BIN:$PATH" "$@"
    ;;
  *) die "usage: $0 up|down|build|exec CMD…" ;;
esac
