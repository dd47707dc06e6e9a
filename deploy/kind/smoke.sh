#!/usr/bin/env bash
# Smoke deploy of the Gyre chart on kind, with the three CPU images built from this checkout.
# Needs docker, kind, kubectl, helm, and python with `pip install -e .` (for the smoke client).
#
#   deploy/kind/smoke.sh build     # the three CPU images (deploy/docker/build.sh, as `make images`)
#   deploy/kind/smoke.sh cluster   # kind cluster (1 control plane + 2 workers), images, CRDs, shared volume
#   deploy/kind/smoke.sh install   # helm install with deploy/values-kind.yaml, wait for readiness
#   deploy/kind/smoke.sh check     # port-forward; /v1/models + a chat completion; trainer reaches N steps
#   deploy/kind/smoke.sh test      # helm test
#   deploy/kind/smoke.sh dump      # pods, events, descriptions and logs (on failure)
#   deploy/kind/smoke.sh down      # delete the cluster
#   deploy/kind/smoke.sh all       # build cluster install check test (the default)
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-gyre}
NAMESPACE=${NAMESPACE:-gyre}
RELEASE=${RELEASE:-smoke}
TAG=${TAG:-kind}
MIN_STEPS=${MIN_STEPS:-3}
SHARED_DIR=${SHARED_DIR:-/tmp/gyre-shared}   # must match deploy/kind/cluster.yaml
PROMETHEUS_OPERATOR_VERSION=${PROMETHEUS_OPERATOR_VERSION:-v0.81.0}
PYTHON=${PYTHON:-python3}
FULLNAME="$RELEASE-gyre"
COMPONENTS=(inference trainer orchestrator)

PORT_FORWARDS=()
log() { printf '\n=== %s\n' "$*"; }
stop_port_forwards() { if [ ${#PORT_FORWARDS[@]} -gt 0 ]; then kill "${PORT_FORWARDS[@]}" 2>/dev/null || true; fi; }
trap stop_port_forwards EXIT

build() {
  # the same builds as `make images` (deploy/docker/build.sh: the CPU targets, torch from PyTorch's CPU index)
  TAG="$TAG" deploy/docker/build.sh
}

cluster() {
  mkdir -p "$SHARED_DIR" && chmod 1777 "$SHARED_DIR"
  if ! kind get clusters | grep -qx "$CLUSTER"; then
    log "kind cluster $CLUSTER"
    kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml --wait 5m
  fi
  for c in "${COMPONENTS[@]}"; do
    kind load docker-image --name "$CLUSTER" "gyre-$c:$TAG"
  done
  log "Prometheus operator CRDs $PROMETHEUS_OPERATOR_VERSION"
  kubectl apply --server-side -f \
    "https://github.com/prometheus-operator/prometheus-operator/releases/download/$PROMETHEUS_OPERATOR_VERSION/stripped-down-crds.yaml"
  kubectl wait --for=condition=Established --timeout=120s crd/servicemonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com
  log "shared volume, namespace $NAMESPACE (Pod Security Standard: restricted, enforced)"
  kubectl apply -f deploy/kind/shared-volume.yaml
  kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
  kubectl label namespace "$NAMESPACE" --overwrite \
    pod-security.kubernetes.io/enforce=restricted pod-security.kubernetes.io/warn=restricted
}

install() {
  log "helm install $RELEASE"
  helm upgrade --install "$RELEASE" charts/gyre -n "$NAMESPACE" -f deploy/values-kind.yaml --wait --timeout 15m
  # --wait covers Deployments and StatefulSets; say it explicitly for the record.
  kubectl -n "$NAMESPACE" rollout status "deployment/$FULLNAME-inference" --timeout=10m
  kubectl -n "$NAMESPACE" rollout status "deployment/$FULLNAME-orchestrator" --timeout=5m
  kubectl -n "$NAMESPACE" rollout status "statefulset/$FULLNAME-trainer" --timeout=10m
  kubectl -n "$NAMESPACE" get servicemonitors.monitoring.coreos.com
  kubectl -n "$NAMESPACE" get pods -o wide
}

check() {
  local api_key
  api_key=$(kubectl -n "$NAMESPACE" get secret "$FULLNAME-secrets" -o jsonpath='{.data.api-key}' | base64 -d)
  kubectl -n "$NAMESPACE" port-forward "svc/$FULLNAME-inference" 18000:8000 >/tmp/gyre-pf-inference.log 2>&1 &
  PORT_FORWARDS+=($!)
  kubectl -n "$NAMESPACE" port-forward "svc/$FULLNAME-trainer" 15071:50071 >/tmp/gyre-pf-trainer.log 2>&1 &
  PORT_FORWARDS+=($!)
  sleep 3
  log "smoke client: API and >= $MIN_STEPS training steps"
  "$PYTHON" deploy/kind/smoke_client.py --base-url http://127.0.0.1:18000/v1 --api-key "$api_key" \
    --trainer 127.0.0.1:15071 --min-steps "$MIN_STEPS" --timeout 1200
}

helm_test() {
  log "helm test $RELEASE"
  helm test "$RELEASE" -n "$NAMESPACE" --logs --timeout 5m
}

dump() {
  set +e
  log "pods";   kubectl -n "$NAMESPACE" get pods,svc,endpointslices,pvc -o wide
  log "events"; kubectl -n "$NAMESPACE" get events --sort-by=.lastTimestamp
  log "nodes";  kubectl get nodes --show-labels; kubectl get pv
  for pod in $(kubectl -n "$NAMESPACE" get pods -o name); do
    log "describe $pod"; kubectl -n "$NAMESPACE" describe "$pod"
    log "logs $pod";     kubectl -n "$NAMESPACE" logs "$pod" --all-containers --prefix --tail=300
    kubectl -n "$NAMESPACE" logs "$pod" --all-containers --prefix --previous --tail=100 2>/dev/null
  done
  return 0
}

down() { kind delete cluster --name "$CLUSTER"; }

case "${1:-all}" in
  build) build ;;
  cluster) cluster ;;
  install) install ;;
  check) check ;;
  test) helm_test ;;
  dump) dump ;;
  down) down ;;
  all) build; cluster; install; check; helm_test ;;
  *) echo "usage: $0 [build|cluster|install|check|test|dump|down|all]" >&2; exit 2 ;;
esac
