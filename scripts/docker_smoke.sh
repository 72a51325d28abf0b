#!/usr/bin/env bash
# `make docker-smoke`: build the hookserve image and prove it serves.
#
#   1. finds a Docker engine (or starts dockerd with its state under DOCKER_ROOT, when
#      dockerd is installed and we are root), and a base image: BASE_IMAGE if set,
#      else python:3.11-slim if a registry answers, else a Debian base built locally
#      with debootstrap (local/debian-py:bookworm);
#   2. fills deploy/wheels/ from the host's package index (pip download) and builds
#      with --build-arg OFFLINE=1, so the build needs no network inside containers;
#   3. runs tests/test_docker.py -m docker against the image: start, health SERVING,
#      extract through the SDK vs in-process results for the same mounted weights
#      file, SIGTERM and a clean exit within the grace period.
#
# Environment: HOOKSERVE_IMAGE (tag, default hookserve:smoke), BASE_IMAGE, EXTRAS
# (package extras in the image, default server,batch), PYTHON
# (default .venv/bin/python), DOCKER_ROOT (dockerd state when we start it, /tmp/d),
# SMOKE_BUILD_ONLY=1 (stop after the build).
# Exit status: 0 passed, 1 failed, 2 no Docker engine could be reached or started.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${HOOKSERVE_IMAGE:-hookserve:smoke}
PY=${PYTHON:-.venv/bin/python}
DOCKER_ROOT=${DOCKER_ROOT:-/tmp/d}
export DOCKER_BUILDKIT=0   # the legacy builder: the Dockerfile needs nothing newer
started_dockerd=""

log() { printf '[docker-smoke] %s\n' "$*" >&2; }

cleanup() {
  if [[ -n "$started_dockerd" ]]; then
    log "stopping the dockerd we started (pid $started_dockerd)"
    kill -TERM "$started_dockerd" 2>/dev/null || true
  fi
}
trap cleanup EXIT

engine() {
  if docker info >/dev/null 2>&1; then return 0; fi
  if ! command -v dockerd >/dev/null || [[ $(id -u) != 0 ]]; then
    log "no Docker engine reachable, and dockerd cannot be started here"
    log "(install it with: apt-get install -y docker.io)"
    exit 2
  fi
  log "starting dockerd (data in $DOCKER_ROOT)"
  mkdir -p "$DOCKER_ROOT"
  dockerd --data-root "$DOCKER_ROOT/data" --exec-root "$DOCKER_ROOT/exec" \
    --pidfile "$DOCKER_ROOT/dockerd.pid" >"$DOCKER_ROOT/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$started_dockerd" 2>/dev/null || break
    sleep 0.5
  done
  log "dockerd did not come up; see $DOCKER_ROOT/dockerd.log"
  exit 2
}

base_image() {
  if [[ -n "${BASE_IMAGE:-}" ]]; then echo "$BASE_IMAGE"; return; fi
  if docker image inspect python:3.11-slim >/dev/null 2>&1 \
     || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    echo python:3.11-slim; return
  fi
  local local_base=local/debian-py:bookworm
  if ! docker image inspect "$local_base" >/dev/null 2>&1; then
    log "no registry reachable: building $local_base with debootstrap (about a minute)"
    command -v debootstrap >/dev/null || { log "needs debootstrap (apt-get install -y debootstrap)"; exit 1; }
    local rootfs
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/hookserve-rootfs.XXXXXX")
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
      bookworm "$rootfs" >&2
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$local_base" >/dev/null
    rm -rf "$rootfs"
  fi
  echo "$local_base"
}

wheels() {
  # Runtime requirements straight from pyproject.toml (core + the image's extras), plus
  # the exact torch pair the Dockerfile asks for and what pip needs to build our package.
  local reqs
  reqs=$(mktemp)
  "$PY" - "${EXTRAS:-server,batch}" >"$reqs" <<'EOF'
import sys
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [r for e in sys.argv[1].split(",") for r in p["optional-dependencies"][e]]
print("\n".join(p["dependencies"] + extras))
EOF
  log "filling deploy/wheels/ (pip download; skips wheels already there)"
  "$PY" -m pip download -q -d deploy/wheels "torch==2.14.1" "torchvision==0.29.1" \
    -r "$reqs" "setuptools>=68" wheel 2> >(grep -v "is neither a file nor a directory" >&2)
  rm -f "$reqs"
}

engine
base=$(base_image)
wheels
log "building $IMAGE on $base (legacy builder)"
start=$(date +%s)
docker build -t "$IMAGE" \
  --build-arg BASE_IMAGE="$base" \
  --build-arg OFFLINE=1 \
  --build-arg EXTRAS="${EXTRAS:-server,batch}" \
  --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
  --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  .
log "built $IMAGE in $(( $(date +%s) - start )) s; size $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
[[ "${SMOKE_BUILD_ONLY:-}" == 1 ]] && exit 0

log "running tests/test_docker.py -m docker against $IMAGE"
HOOKSERVE_IMAGE="$IMAGE" "$PY" -m pytest -v -m docker -p no:cacheprovider tests/test_docker.py
