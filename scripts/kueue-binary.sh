#!/usr/bin/env bash
# Builds the real Kueue manager for tests/realk8s (the shared-cluster tests against Kueue
# itself, not the project's emulation of its documented behaviour) from its Go module with
# the ordinary `go` client, into a cache outside the repo beside the control plane:
#   ${CEPHALO_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/cephalo-k8s}/kueue-<version>/
#     bin/kueue            the manager (controllers and webhooks in one process)
#     crds/*.yaml          its CustomResourceDefinitions (config/components/crd/bases)
#     webhooks.yaml        its webhook configurations (config/components/webhook)
# sigs.k8s.io/kueue has no replace directives, so `go install module@version` builds it as
# released. Idempotent (a complete cache is a no-op) and atomic (built in a temporary
# folder, renamed into place with a BUILD-INFO stamp written last). Prints the cache folder
# last. Environment: K8S_BUILD_JOBS (default 2) limits go's parallel package builds.
set -euo pipefail
KUEUE_VERSION=v0.17.0
root=${CEPHALO_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cephalo-k8s}
dest="$root/kueue-$KUEUE_VERSION"
if [ -f "$dest/BUILD-INFO" ] && [ -x "$dest/bin/kueue" ]; then
    echo "kueue-binary: cached Kueue $KUEUE_VERSION in $dest" >&2
    echo "$dest"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    echo "kueue-binary: 'go' is not on PATH; install Go >= 1.25 to build Kueue" >&2
    exit 3
fi
mkdir -p "$root"
work=$(mktemp -d "$root/.kueue-build-XXXXXX")
# Module and build caches go with the throwaway folder (as in k8s-binaries.sh).
export GOCACHE="$work/go-build" GOMODCACHE="$work/go-mod" GOFLAGS="${GOFLAGS:-} -modcacherw"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/out/bin" "$work/out/crds"
started=$(date +%s)
echo "kueue-binary: building Kueue $KUEUE_VERSION into $dest (go -p ${K8S_BUILD_JOBS:-2})" >&2
src=$(go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
[ -d "$src" ] || { echo "kueue-binary: could not download sigs.k8s.io/kueue@$KUEUE_VERSION" >&2; exit 1; }
GOBIN="$work/out/bin" nice -n 10 go install -p "${K8S_BUILD_JOBS:-2}" -trimpath \
    -ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
cp "$src"/config/components/crd/bases/*.yaml "$work/out/crds/"
cp "$src/config/components/webhook/manifests.yaml" "$work/out/webhooks.yaml"
chmod -R u+w "$work/out"
cat > "$work/out/BUILD-INFO" <<EOF
kueue $KUEUE_VERSION
go $(go env GOVERSION)
build_seconds $(( $(date +%s) - started ))
EOF
rm -rf "$dest"
mv "$work/out" "$dest"
echo "kueue-binary: done in $(( $(date +%s) - started )) s: $dest" >&2
echo "$dest"
