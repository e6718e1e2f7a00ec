#!/usr/bin/env bash
# lifl's Kubernetes test bed: a real control plane with real Knative Serving on this machine.
#
#   scripts/k8s-testenv.sh up [--real-node]  build what is missing (cached), start everything; prints the kubeconfig's path last
#   scripts/k8s-testenv.sh exec CMD…         run CMD inside the test bed (KUBECONFIG set, its kubectl first on PATH)
#   scripts/k8s-testenv.sh down              stop and remove everything `up` started
#   scripts/k8s-testenv.sh build             only build (or check) the binaries and lifl's images
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
# --real-node (or LIFL_TESTENV_REAL_NODE=1) adds the node `real1`, whose pods are real containers:
# Debian's containerd (CRI, runc) and a kubelet built from the same module, in the same namespace.
# Its pods get IPs on a CNI bridge (10.88.0.0/16) reachable from the namespace, and run lifl's
# images, which scripts/images.sh builds and imports (nothing is ever pulled). Its processes and
# pods live in the cgroup `lifl-testenv` of every hierarchy; `down` removes them, their mounts and
# cgroups, and restores the host sysctls the kubelet sets. Host directories of its pods belong under
# its state too: tests/k8s/bed.py points lifl's node DaemonSet's (/run/lifl, /var/lib/lifl on a
# real host) to $STATE/real1/host/..., which `down` removes with the rest of the state.
#
# Needs root (network namespaces), Go 1.24+, etcd-server and openssl, and for the real node
# containerd, runc, containernetworking-plugins and what scripts/images.sh needs (scripts/install.sh
# installs them all). LIFL_TESTENV_CACHE (default ~/.cache/lifl-testenv) keeps the binaries and
# images; LIFL_TESTENV_DIR (default /run/lifl-testenv) the running bed's state and logs, the real
# node's containers and images included; LIFL_TESTENV_NODES fake nodes (3).
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
STOP_TIMEOUT_S=30
IMAGES="$ROOT/scripts/images.sh"
# the real node (--real-node)
REAL_NODE=real1              # a valid lifl node id: 1-16 lowercase letters or digits
REAL_NODE_IP=10.200.0.2      # another alias on the namespace's loopback
REAL_POD_CIDR=10.88.0.0/16   # its CNI bridge's; clear of kwok's pod range and the service range
REAL_NODE_LABEL=lifl.dev/real-node
NODE_DIR="$STATE/$REAL_NODE"  # containerd's root and state, the kubelet's, CNI's: every mount the node makes is under it
CONTAINERD_SOCK="$NODE_DIR/containerd.sock"
PAUSE_IMAGE=dev.local/lifl/pause:3.10
NODE_CGROUP="$NETNS"         # in every cgroup hierarchy: the kubelet's cgroup root, and its daemons' (and so their shims')
# what the kubelet sets on the host when it starts (pkg/kubelet/cm setupKernelTunables): restored on down
KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)

say() { echo "k8s-testenv: $*" >&2; }
die() { say "$*"; exit 1; }

# nsenter, not `ip netns exec`: that one also gives each command a private mount namespace with a
# fresh /sys (no cgroups, no bpffs), where the kubelet's volume mounts would be invisible to
# containerd's containers and the node's mounts to `down`
NSENTER=(nsenter --net="/run/netns/$NETNS")
in_netns() { "${NSENTER[@]}" "$@"; }

# -- build ---------------------------------------------------------------------------------------
stamp_of() {  # what a build depends on: the module files and this script's build steps
  cat "$ROOT"/scripts/k8s/*/go.mod "$ROOT"/scripts/k8s/*/go.sum <(sed -n '/^# -- build/,/^# -- end of build/p' "$0") | sha256sum | cut -d' ' -f1
}

go_build() {  # module dir, output name, package, extra flags...
  local module="$1" out="$2" package="$3"
  shift 3
  (cd "$ROOT/scripts/k8s/$module" && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go build -trimpath -o "$BIN/$out" "$@" "$package")
}

build() {  # the binaries (again only when the stamp changed), then lifl's images (scripts/images.sh keeps its own cache)
  build_binaries
  [ -x "$IMAGES" ] || die "$IMAGES is missing: it builds the images the real node runs"
  LIFL_TESTENV_CACHE="$CACHE" "$IMAGES" build
}

build_binaries() {
  local stamp
  stamp="$(stamp_of)"
  if [ -f "$CACHE/stamp" ] && [ "$(cat "$CACHE/stamp")" = "$stamp" ]; then
    return 0
  fi
  command -v go >/dev/null || die "building the test bed needs Go 1.24 or newer"
  say "building the control plane, the kubelet, kwok and Knative Serving from Go modules (first time: about 15 minutes)"
  mkdir -p "$BIN"
  local v=k8s.io/component-base/version
  local kube_ldflags="-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=32 -X $v.gitTreeState=clean"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
    go_build kube "$cmd" "k8s.io/kubernetes/cmd/$cmd" -ldflags "$kube_ldflags"
  done
  go_build kwok kwok sigs.k8s.io/kwok/cmd/kwok -ldflags "-s -w"
  for cmd in controller webhook autoscaler; do
    go_build knative "knative-$cmd" "knative.dev/serving/cmd/$cmd" -ldflags "-s -w"
  done
  # queue-proxy goes into an image of its own, whatever that image's base: static, with no libc
  CGO_ENABLED=0 go_build knative knative-queue knative.dev/serving/cmd/queue -ldflags "-s -w"
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

start() {  # [--in-node-cgroup] name, command...: a daemon inside the namespace, logged and remembered
  local in_node_cgroup=0
  if [ "$1" = --in-node-cgroup ]; then
    in_node_cgroup=1
    shift
  fi
  local name="$1"
  shift
  (
    ((in_node_cgroup)) && join_node_cgroup "$BASHPID"
    exec "${NSENTER[@]}" setsid "$@"  # one process: its pid is the daemon's and its process group's
  ) >"$STATE/logs/$name.log" 2>&1 < /dev/null &
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

listens_on() { in_netns ss -Htlnp "sport = :$1" | grep -q "pid=$(cat "$STATE/pids/$2"),"; }  # port, daemon

kubectl_() { in_netns env KUBECONFIG="$KUBECONFIG_PATH" "$BIN/kubectl" "$@"; }

sign() {  # name, subject, extensions: a key and a certificate of the bed's CA
  local d="$STATE/pki"
  openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
  openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 \
    -extfile <(printf '%s\n' "$3") -out "$d/$1.crt" 2>/dev/null
}

certificates() {
  local d="$STATE/pki"
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=lifl-testenv-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  sign apiserver "/CN=kube-apiserver" \
    "subjectAltName=IP:$ADDR,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=lifl-testenv-admin" "extendedKeyUsage=clientAuth"
  # what the API server shows kubelets (and kwok) for logs, exec and port-forward
  sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  kubeconfig admin > "$KUBECONFIG_PATH"
}

kubeconfig() {  # the client certificate's name (in the bed's pki)
  local d="$STATE/pki"
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: lifl-testenv
  cluster: {server: "https://$ADDR:6443", certificate-authority: "$d/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$d/$1.crt", client-key: "$d/$1.key"}
contexts:
- name: lifl-testenv
  context: {cluster: lifl-testenv, user: $1}
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

# -- the real node ---------------------------------------------------------------------------------
CTR=(ctr --address "$CONTAINERD_SOCK" --connect-timeout 5s --namespace k8s.io)
# where the node writes outside NODE_DIR, whatever its configuration: the kubelet's links to its
# pods' logs and its device-plugin socket, the CNI library's cache of results, the shims' sockets
CONTAINER_LOG_LINKS=/var/log/containers
DEVICE_PLUGINS=/var/lib/kubelet/device-plugins
CNI_RESULTS=/var/lib/cni/results
SHIM_SOCKETS=/run/containerd/s

need_real_node_tools() {
  local tool
  for tool in containerd containerd-shim-runc-v2 runc ctr; do
    command -v "$tool" >/dev/null || die "the real node needs $tool (Debian's containerd and runc; scripts/install.sh installs them)"
  done
  [ -x /usr/lib/cni/bridge ] || die "the real node needs the CNI plugins in /usr/lib/cni (Debian's containernetworking-plugins)"
}

cgroup_hierarchies() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts; }

make_node_cgroups() {  # NODE_CGROUP and its daemons' cgroup, in every hierarchy
  local h d
  for h in $(cgroup_hierarchies); do
    for d in "$h/$NODE_CGROUP" "$h/$NODE_CGROUP/daemons"; do
      mkdir -p "$d"
      if [ -f "$d/cpuset.cpus" ] && [ -z "$(cat "$d/cpuset.cpus")" ]; then  # v1 cpuset: none until given its parent's
        cat "${d%/*}/cpuset.cpus" > "$d/cpuset.cpus"
        cat "${d%/*}/cpuset.mems" > "$d/cpuset.mems"
      fi
    done
  done
}

join_node_cgroup() {  # pid: into the daemons' cgroup, where whatever it starts stays (containerd's shims too)
  local h
  for h in $(cgroup_hierarchies); do
    echo "$1" > "$h/$NODE_CGROUP/daemons/cgroup.procs"
  done
}

containerd_config() {
  cat <<EOF
version = 2
root = "$NODE_DIR/containerd/root"
state = "$NODE_DIR/containerd/state"

[grpc]
  address = "$CONTAINERD_SOCK"

[plugins."io.containerd.internal.v1.opt"]
  path = "$NODE_DIR/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true  # root here lacks CAP_SYS_RESOURCE, so no container may go below containerd's own score
  netns_mounts_under_state_dir = true  # the pods' network namespaces, instead of /var/run/netns
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"  # not crun, which refuses hybrid cgroups
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false  # no systemd here: cgroupfs, as the kubelet's driver
        Root = "$NODE_DIR/runc"  # runc's state, instead of /run/containerd/runc
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$NODE_DIR/cni"
EOF
}

cni_config() {  # a bridge with the pods' gateway on it; containerd itself gives each pod its loopback
  cat <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$NETNS",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$REAL_POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$NODE_DIR/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

kubelet_config() {
  cat <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $REAL_NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:  # the API server's client certificate (kubectl logs, exec), checked against the bed's CA
  anonymous: {enabled: false}
  x509: {clientCAFile: "$STATE/pki/ca.crt"}
  webhook: {enabled: true}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
cgroupDriver: cgroupfs
cgroupRoot: /$NODE_CGROUP
failCgroupV1: false  # this machine has hybrid cgroups
failSwapOn: false
serverTLSBootstrap: false  # it signs its own serving certificate, which the API server does not check
rotateCertificates: false
podLogsDir: $NODE_DIR/pod-logs
volumePluginDir: $NODE_DIR/volume-plugins
# the node shares the host's disk with everything else on it: evict only when it is really full
evictionHard: {memory.available: 100Mi, nodefs.available: 1Gi, imagefs.available: 1Gi, nodefs.inodesFree: "1%"}
# lifl's images are imported, never pulled: never collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
EOF
}

start_real_node() {  # containerd, lifl's images going in, the kubelet (up waits for both at the end)
  mkdir -p "$NODE_DIR/cni"
  in_netns ip addr add "$REAL_NODE_IP/32" dev lo
  sign "$REAL_NODE" "/O=system:nodes/CN=system:node:$REAL_NODE" "extendedKeyUsage=clientAuth"
  kubeconfig "$REAL_NODE" > "$NODE_DIR/kubeconfig"
  containerd_config > "$NODE_DIR/containerd.toml"
  cni_config > "$NODE_DIR/cni/10-lifl-testenv.conflist"
  kubelet_config > "$NODE_DIR/kubelet.yaml"
  make_node_cgroups
  local dir  # the host's directories the node is about to make, deepest first: down removes them
  for dir in "$CONTAINER_LOG_LINKS" "$DEVICE_PLUGINS" "$CNI_RESULTS" "$SHIM_SOCKETS"; do
    while [ ! -e "$dir" ]; do
      echo "$dir"
      dir="${dir%/*}"
    done
  done > "$NODE_DIR/made-host-dirs"
  start --in-node-cgroup containerd containerd --config "$NODE_DIR/containerd.toml"
  wait_for "containerd" "${CTR[@]}" version
  # lifl's images go in while the rest comes up (about half a minute); up waits for them at the end
  LIFL_TESTENV_CACHE="$CACHE" "$IMAGES" import --address "$CONTAINERD_SOCK" >"$STATE/logs/images-import.log" 2>&1 &
  images_import=$!
  [ -f "$STATE/sysctls" ] || sysctl "${KUBELET_SYSCTLS[@]}" > "$STATE/sysctls"  # before the kubelet changes them
  start --in-node-cgroup kubelet "$BIN/kubelet" --config="$NODE_DIR/kubelet.yaml" --kubeconfig="$NODE_DIR/kubeconfig" \
    --hostname-override="$REAL_NODE" --node-ip="$REAL_NODE_IP" --node-labels="$REAL_NODE_LABEL=true" \
    --root-dir="$NODE_DIR/kubelet" --cert-dir="$NODE_DIR/kubelet-pki"
}

alive() { local stat; stat="$(ps -o stat= -p "$1")" && [[ $stat != Z* ]]; }

stop_daemon() {  # name: TERM, then KILL once it has outlived STOP_TIMEOUT_S
  local pidfile="$STATE/pids/$1" pid deadline=$((SECONDS + STOP_TIMEOUT_S))
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  kill -TERM "$pid" 2>/dev/null || true
  while alive "$pid"; do
    ((SECONDS < deadline)) || kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  done
  rm -f "$pidfile"
}

node_cgroup_pids() {
  local h
  for h in $(cgroup_hierarchies); do
    if [ -d "$h/$NODE_CGROUP" ]; then find "$h/$NODE_CGROUP" -name cgroup.procs -exec cat {} +; fi
  done | sort -un
}

remove_node_cgroups() {  # with every process left in them: containers, their shims, the daemons
  local pids h deadline=$((SECONDS + STOP_TIMEOUT_S))
  while pids="$(node_cgroup_pids)"; [ -n "$pids" ]; do
    ((SECONDS < deadline)) || die "these processes outlive SIGKILL in the cgroup $NODE_CGROUP: $pids"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.2
  done
  for h in $(cgroup_hierarchies); do
    if [ -d "$h/$NODE_CGROUP" ]; then
      find "$h/$NODE_CGROUP" -depth -type d -exec rmdir {} + || die "cannot remove the cgroup $h/$NODE_CGROUP"
    fi
  done
}

last_mount_under() { awk -v d="$1" '$2 == d || index($2, d "/") == 1 {m = $2} END {print m}' /proc/self/mounts; }

unmount_under() {  # dir: every mount at or under it, the latest first
  local mnt deadline=$((SECONDS + STOP_TIMEOUT_S))
  while mnt="$(last_mount_under "$1")"; [ -n "$mnt" ]; do
    ((SECONDS < deadline)) || die "cannot unmount $mnt"
    umount "$mnt" 2>/dev/null || umount --lazy "$mnt"
  done
}

remove_host_entries() {  # the node's entries in those paths outside NODE_DIR, then the directories it made
  local result id dir
  if [ -d "$CONTAINER_LOG_LINKS" ]; then find "$CONTAINER_LOG_LINKS" -maxdepth 1 -type l -lname "$NODE_DIR/*" -delete; fi
  for result in "$CNI_RESULTS/$NETNS"-*-eth0; do  # <network>-<sandbox>-<interface>, and containerd's loopback
    [ -e "$result" ] || continue
    id="${result#"$CNI_RESULTS/$NETNS-"}"
    rm -f "$result" "$CNI_RESULTS/cni-loopback-${id%-eth0}-lo"
  done
  if [ -f "$NODE_DIR/made-host-dirs" ]; then
    if grep -qx "$DEVICE_PLUGINS" "$NODE_DIR/made-host-dirs"; then
      rm -f "$DEVICE_PLUGINS/kubelet.sock" "$DEVICE_PLUGINS/kubelet_internal_checkpoint"
    fi
    while read -r dir; do  # those it made: an `up` that failed early made none
      if [ -d "$dir" ]; then rmdir --ignore-fail-on-non-empty "$dir"; fi
    done < "$NODE_DIR/made-host-dirs"
  fi
}

stop_real_node() {  # all of it, also after an `up` that failed half way
  local shim_sockets id
  shim_sockets="$(sed 's|^unix://||' "$NODE_DIR"/containerd/state/io.containerd.runtime.v2.task/*/*/address 2>/dev/null || true)"
  stop_daemon kubelet  # first: it would start the containers again
  if "${CTR[@]}" version >/dev/null 2>&1; then
    # containerd kills, deletes and unmounts what it can; a shim exits with its last task
    for id in $("${CTR[@]}" tasks ls --quiet); do
      "${CTR[@]}" tasks delete --force "$id" >/dev/null 2>&1 || true
    done
    for id in $("${CTR[@]}" containers ls --quiet); do
      "${CTR[@]}" containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  stop_daemon containerd
  remove_node_cgroups
  # shellcheck disable=SC2086  # socket paths: no spaces
  rm -f $shim_sockets  # those of shims that were killed
  unmount_under "$STATE"
  if [ -f "$STATE/sysctls" ]; then sysctl -q -p "$STATE/sysctls"; fi
  remove_host_entries
}

up() {  # real node: 1 or 0
  local real_node="$1"
  need_root
  ((real_node)) && need_real_node_tools
  build
  ensure_etcd
  if ip netns list | grep -qw "$NETNS"; then
    die "already up (scripts/k8s-testenv.sh down first); kubeconfig: $KUBECONFIG_PATH"
  fi
  # an earlier real node's mounts: removing the directory would reach into them
  [ -z "$(last_mount_under "$STATE")" ] || die "$(last_mount_under "$STATE") is still mounted (scripts/k8s-testenv.sh down first)"
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
    --feature-gates=WatchList=false --enable-priority-and-fairness=false --profiling=false \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP,Hostname  # no DNS for node names here
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
  if ((real_node)); then start_real_node; fi

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
  # The autoscaler's stats server and the controller's health probes both take :8080, fixed in
  # their code; in one namespace the first to bind wins. The autoscaler must (its stats server's
  # failure stops its elector and reconcilers; the controller's probes' stops only the probes).
  # shellcheck disable=SC2046
  start knative-autoscaler env $(knative_env autoscaler 9191) "$BIN/knative-autoscaler"
  wait_for "Knative's autoscaler's stats server on :8080" listens_on 8080 knative-autoscaler
  # shellcheck disable=SC2046
  start knative-controller env $(knative_env controller 9190) "$BIN/knative-controller"
  wait_for "Knative's webhook" nonempty kubectl_ get mutatingwebhookconfiguration webhook.serving.knative.dev \
    -o 'jsonpath={.webhooks[0].clientConfig.caBundle}'
  wait_for "Knative's autoscaler to lead its bucket" nonempty kubectl_ get lease autoscaler-bucket-00-of-01 \
    -n knative-serving -o 'jsonpath={.spec.holderIdentity}'
  wait_for "the kwok nodes" kubectl_ wait --for=condition=Ready --timeout=5s node --all
  local nodes="$NODES kwok nodes"
  if ((real_node)); then
    wait "$images_import" || die "importing lifl's images into the real node's containerd failed (log: $STATE/logs/images-import.log)"
    wait_for "the real node $REAL_NODE to be Ready" kubectl_ wait --for=condition=Ready --timeout=5s "node/$REAL_NODE"
    nodes+=", the real node $REAL_NODE (containerd, pods on $REAL_POD_CIDR)"
  fi
  say "up: $nodes, Knative Serving v0.42.2 (logs in $STATE/logs)"
  echo "$KUBECONFIG_PATH"
}

down() {
  need_root
  stop_real_node
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
  up)
    shift
    real_node="${LIFL_TESTENV_REAL_NODE:-0}"
    [[ $real_node =~ ^[01]$ ]] || die "LIFL_TESTENV_REAL_NODE must be 0 or 1, not '$real_node'"
    for option; do
      [ "$option" = --real-node ] || die "up: unknown option '$option' (usage: $0 up [--real-node])"
      real_node=1
    done
    up "$real_node"
    ;;
  down) down ;;
  exec)
    shift
    [ $# -gt 0 ] || die "exec needs a command"
    [ -f "$KUBECONFIG_PATH" ] || die "not up (scripts/k8s-testenv.sh up)"
    exec "${NSENTER[@]}" env KUBECONFIG="$KUBECONFIG_PATH" PATH="$BIN:$PATH" "$@"
    ;;
  *) die "usage: $0 up [--real-node]|down|build|exec CMD…" ;;
esac
