#!/usr/bin/env bash
# Build Gyre's three CPU images from this checkout with Docker's legacy builder:
#   gyre-inference:$TAG  gyre-trainer:$TAG  gyre-orchestrator:$TAG      (TAG=kind: what deploy/values-kind.yaml runs)
#
#   deploy/docker/build.sh            # base (only when needed), then the three images
#   deploy/docker/build.sh base       # only the base images
#   deploy/docker/build.sh images     # only the three images (PYTHON_IMAGE as below)
#
# Base image: the Dockerfiles' default (`ARG PYTHON_IMAGE`, Docker Hub's python image) when it is present or
# can be pulled. Where Docker Hub is unreachable, a local Debian base is built instead and kept for the next
# run: `debootstrap --variant=minbase` of Debian bookworm from the host's apt mirror, imported as
# gyre-local/debian:bookworm, then gyre-local/python:3.11-bookworm (deploy/docker/Dockerfile.python: python3,
# venv, pip and the host's CA bundle, so pip in the build reaches PyPI through a TLS-inspecting proxy), and
# gyre-local/redis:7-bookworm (Debian's redis-server) for the container smoke, which stands in for the
# chart's Redis image from Docker Hub.
#
# torch: the exact version pinned in constraints.txt. A matching CPU wheel in pip's find-links folders
# (`pip config list`, PIP_FIND_LINKS) or TORCH_WHEEL is copied into the build context (deploy/docker/wheels/);
# without one the build downloads it from TORCH_INDEX (the Dockerfiles' default: PyTorch's CPU index).
#
# Environment: TAG (kind), PYTHON_IMAGE (skip detection), REBUILD_BASE=1 (rebuild the local base),
# DEBIAN_MIRROR / DEBIAN_SECURITY_MIRROR (default: the host's apt sources), TORCH_WHEEL, TORCH_INDEX, VERSION,
# REVISION, SOURCE (OCI labels; default: pyproject version, git HEAD, the project's repository).
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG=${TAG:-kind}
COMPONENTS=(inference trainer orchestrator)
LOCAL_DEBIAN=gyre-local/debian:bookworm
LOCAL_PYTHON=gyre-local/python:3.11-bookworm
LOCAL_REDIS=gyre-local/redis:7-bookworm
WHEELS=deploy/docker/wheels
export DOCKER_BUILDKIT=0 # BuildKit would pull its `# syntax=` frontend from Docker Hub
NICE=(nice -n "${NICE_LEVEL:-10}")

log() { printf '\n=== %s\n' "$*"; }
elapsed() { echo "$(($(date +%s) - $1)) s"; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# The first apt source URI on the host whose path ends in the given suffix ("debian", "debian-security").
host_mirror() {
  local suffix=$1
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -oE '(https?|file)://[^ ]+' | sed 's:/*$::' | grep -E "/${suffix}\$" | head -n1
  return 0
}

# A hash of what the local Python base is made of: rebuilt when the Dockerfile or the CA bundle changes.
base_inputs_hash() { cat deploy/docker/Dockerfile.python "$CA_BUNDLE" | sha256sum | cut -c1-16; }

CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

build_debian() {
  local mirror security root start
  mirror=${DEBIAN_MIRROR:-$(host_mirror debian)}
  mirror=${mirror:-http://deb.debian.org/debian}
  security=${DEBIAN_SECURITY_MIRROR:-$(host_mirror debian-security)}
  security=${security:-http://deb.debian.org/debian-security}
  command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
  [ "$(id -u)" -eq 0 ] || { echo "debootstrap needs root (run this script with sudo)" >&2; exit 1; }
  log "debootstrap bookworm (minbase) from $mirror -> $LOCAL_DEBIAN"
  start=$(date +%s)
  root=$(mktemp -d /var/tmp/gyre-debootstrap.XXXXXX)
  # shellcheck disable=SC2064  # expand now: the trap must remove this run's folder
  trap "rm -rf '$root'" EXIT
  "${NICE[@]}" debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 ||
    { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
  rm -f "$root.log"
  cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$LOCAL_DEBIAN" >/dev/null
  rm -rf "$root"
  trap - EXIT
  echo "$LOCAL_DEBIAN: $(elapsed "$start")"
}

build_local_base() {
  local hash context start
  [ -r "$CA_BUNDLE" ] || { echo "no CA bundle at $CA_BUNDLE (set CA_BUNDLE)" >&2; exit 1; }
  if [ "${REBUILD_BASE:-0}" = 1 ] || ! have_image "$LOCAL_DEBIAN"; then
    build_debian
  fi
  hash=$(base_inputs_hash)
  if [ "${REBUILD_BASE:-0}" != 1 ] && have_image "$LOCAL_PYTHON" && have_image "$LOCAL_REDIS" &&
    [ "$(docker image inspect -f '{{ index .Config.Labels "dev.gyre.base-inputs" }}' "$LOCAL_PYTHON")" = "$hash" ]; then
    echo "$LOCAL_PYTHON and $LOCAL_REDIS are up to date (cached)"
    return
  fi
  log "$LOCAL_PYTHON and $LOCAL_REDIS (deploy/docker/Dockerfile.python)"
  start=$(date +%s)
  context=$(mktemp -d)
  cp "$CA_BUNDLE" "$context/ca-bundle.crt"
  cp deploy/docker/Dockerfile.python "$context/Dockerfile"
  "${NICE[@]}" docker build -q --build-arg "DEBIAN_IMAGE=$LOCAL_DEBIAN" --label "dev.gyre.base-inputs=$hash" \
    --target python -t "$LOCAL_PYTHON" "$context" >/dev/null
  "${NICE[@]}" docker build -q --build-arg "DEBIAN_IMAGE=$LOCAL_DEBIAN" --label "dev.gyre.base-inputs=$hash" \
    --target redis -t "$LOCAL_REDIS" "$context" >/dev/null
  rm -rf "$context"
  echo "$LOCAL_PYTHON, $LOCAL_REDIS: $(elapsed "$start")"
}

# PYTHON_IMAGE: the Dockerfiles' default when Docker has it or can pull it, else the local base.
choose_base() {
  local default
  default=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile.orchestrator)
  if [ -n "${PYTHON_IMAGE:-}" ]; then
    echo "base: PYTHON_IMAGE=$PYTHON_IMAGE (given)"
  elif have_image "$default" || timeout 300 docker pull -q "$default" >/dev/null 2>&1; then
    PYTHON_IMAGE=$default
    echo "base: $default"
  else
    echo "base: $default cannot be pulled here (Docker Hub unreachable?): building a local Debian base"
    build_local_base
    PYTHON_IMAGE=$LOCAL_PYTHON
  fi
}

# The CPU torch wheel pinned by constraints.txt, from pip's find-links folders, copied into the build context.
stage_torch_wheel() {
  local version wheel="" dir index
  version=$(sed -n 's/^torch==//p' constraints.txt)
  rm -f "$WHEELS"/torch-*.whl
  if [ -n "${TORCH_WHEEL:-}" ]; then
    wheel=$TORCH_WHEEL
  else
    local links
    links="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr '\n' ' ')"
    for dir in $links; do
      dir=${dir#file://}
      [ -d "$dir" ] || continue
      wheel=$(find "$dir" -maxdepth 1 -name "torch-${version}+cpu-cp311-cp311-*x86_64.whl" | sort | tail -n1)
      [ -n "$wheel" ] && break
    done
  fi
  if [ -n "$wheel" ]; then
    cp "$wheel" "$WHEELS/"
    echo "torch: $(basename "$wheel") (copied into $WHEELS/)"
  else
    index=${TORCH_INDEX:-the default TORCH_INDEX}
    echo "torch: no local torch-${version}+cpu wheel; the build downloads it from $index"
  fi
}

build_images() {
  local version revision source c start total args
  choose_base
  stage_torch_wheel
  version=${VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
  revision=${REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  source=${SOURCE:-$(sed -n 's/^home: //p' charts/gyre/Chart.yaml)}
  args=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg "VERSION=$version"
    --build-arg "REVISION=$revision" --build-arg "SOURCE=$source")
  [ -z "${TORCH_INDEX:-}" ] || args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
  total=$(date +%s)
  for c in "${COMPONENTS[@]}"; do
    # inference and trainer: the `cpu` stage (the last one, `gpu`, is the default); orchestrator: one variant
    local target=()
    [ "$c" = orchestrator ] || target=(--target cpu)
    log "gyre-$c:$TAG (Dockerfile.$c ${target[*]})"
    start=$(date +%s)
    "${NICE[@]}" docker build -f "Dockerfile.$c" "${target[@]}" "${args[@]}" -t "gyre-$c:$TAG" .
    echo "gyre-$c:$TAG: $(elapsed "$start")"
  done
  log "built in $(elapsed "$total")"
  docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^gyre-(inference|trainer|orchestrator):$TAG " || true
}

case "${1:-all}" in
  base) build_local_base ;;
  images | all) build_images ;;
  *)
    echo "usage: $0 [all|base|images]" >&2
    exit 2
    ;;
esac
