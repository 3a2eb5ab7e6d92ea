#!/usr/bin/env bash
# Builds the trajflow container image without a daemon and without a
# registry (deploy/image/Dockerfile: FROM scratch).
#
#   deploy/image/build.sh [TAG]     default TAG: localhost/trajflow:$(git describe)
#
# Stages the build context in $IMAGE_CONTEXT (default build/image/context):
# the static binary (CGO_ENABLED=0, -trimpath), the CA bundle of Debian's
# ca-certificates package (installed with apt-get when missing), passwd and
# group, /tmp (1777), the home and data directories; then runs
# $IMAGE_BUILDER (default: podman, else buildah, else docker) on it. Prints
# the tag on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
log() { echo "image: $*" >&2; }

VERSION=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
TAG=${1:-localhost/trajflow:$VERSION}
CTX=${IMAGE_CONTEXT:-$ROOT/build/image/context}
CA=/etc/ssl/certs/ca-certificates.crt

if [ ! -s "$CA" ]; then
  log "installing Debian's ca-certificates"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ca-certificates >/dev/null
fi
CA_VERSION=$(dpkg-query -W -f '${Version}' ca-certificates 2>/dev/null || echo unknown)

builder=${IMAGE_BUILDER:-}
if [ -z "$builder" ]; then
  for b in podman buildah docker; do
    if command -v "$b" >/dev/null; then builder=$b; break; fi
  done
fi
[ -n "$builder" ] || { log "no image builder: apt-get install podman (or buildah)"; exit 1; }

rm -rf "$CTX"
mkdir -p "$CTX/rootfs/usr/local/bin" "$CTX/rootfs/etc/ssl/certs" "$CTX/rootfs/tmp" \
  "$CTX/home/trajflow" "$CTX/data"
log "building the static binary"
CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags "-s -w" -o "$CTX/rootfs/usr/local/bin/trajflow" ./cmd/trajflow
cp "$CA" "$CTX/rootfs/etc/ssl/certs/ca-certificates.crt"
cp deploy/image/passwd "$CTX/rootfs/etc/passwd"
cp deploy/image/group "$CTX/rootfs/etc/group"
chmod 0755 "$CTX/rootfs/usr/local/bin/trajflow" "$CTX/home/trajflow" "$CTX/data"
chmod 0644 "$CTX/rootfs/etc/passwd" "$CTX/rootfs/etc/group" "$CTX/rootfs/etc/ssl/certs/ca-certificates.crt"
chmod 1777 "$CTX/rootfs/tmp"

log "$builder build -t $TAG ($CTX)"
case "$builder" in
  buildah) cmd=(buildah bud) ;;
  *) cmd=("$builder" build) ;;
esac
"${cmd[@]}" -q --no-cache -f deploy/image/Dockerfile -t "$TAG" \
  --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
  --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" --build-arg CA_CERTIFICATES="$CA_VERSION" \
  "$CTX" >&2
echo "$TAG"
