#!/usr/bin/env bash
# Builds the real Kubernetes control plane for tests/realk8s from Go modules, with the
# ordinary `go` client, into a cache outside the repo:
#   ${CEPHALO_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/cephalo-k8s}/<k8s version>/bin/
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes),
# etcd (go.etcd.io/etcd/server/v3 at the version that Kubernetes release requires) and
# helm (helm.sh/helm/v3).
#
# k8s.io/kubernetes is not `go install`-able: its go.mod replaces the k8s.io/* staging
# modules with local folders. A throwaway build module requires it and replaces each
# staging module with its published v0.<minor>.<patch>, read from Kubernetes' own go.mod.
#
# Idempotent (a complete cache is a no-op) and atomic (built in a temporary folder, renamed
# into place with a BUILD-INFO stamp written last). Prints the path of the bin folder last.
# Environment: K8S_BUILD_JOBS (default 2) limits go's parallel package builds.
set -euo pipefail

K8S_VERSION=v1.36.3   # staging modules are published as v0.36.3
HELM_VERSION=v3.20.2
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)

root=${CEPHALO_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cephalo-k8s}
dest="$root/$K8S_VERSION"

complete() {
    [ -f "$1/BUILD-INFO" ] || return 1
    local b
    for b in "${BINARIES[@]}"; do [ -x "$1/bin/$b" ] || return 1; done
}

if complete "$dest"; then
    echo "k8s-binaries: cached $K8S_VERSION in $dest" >&2
    echo "$dest/bin"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    echo "k8s-binaries: 'go' is not on PATH; install Go >= 1.26 to build the control plane" >&2
    exit 3
fi

mkdir -p "$root"
work=$(mktemp -d "$root/.build-XXXXXX")
# Go's module and build caches live in the throwaway folder too and go with it (about
# 4.6 GB after this build): once the binaries are cached nothing reads them again, and on a
# CI machine whose disk is nearly full they are what would fill it (-modcacherw: the module
# cache is then removable without a chmod).
export GOCACHE="$work/go-build" GOMODCACHE="$work/go-mod" GOFLAGS="${GOFLAGS:-} -modcacherw"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/out/bin" "$work/mod"
jobs=${K8S_BUILD_JOBS:-2}
started=$(date +%s)
echo "k8s-binaries: building Kubernetes $K8S_VERSION, etcd and helm $HELM_VERSION" \
     "into $dest (go -p $jobs; the first build takes a long time)" >&2

timed() {  # timed NAME CMD...: runs CMD, prints how long it took
    local t0=$SECONDS
    echo "k8s-binaries: building $1 ..." >&2
    "${@:2}"
    echo "k8s-binaries: $1 built in $((SECONDS - t0)) s" >&2
}

# --- the build module ---------------------------------------------------------------------
cd "$work/mod"
go mod init cephalo-k8s-build >/dev/null 2>&1
gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -f "$gomod" ] || { echo "k8s-binaries: could not download k8s.io/kubernetes@$K8S_VERSION" >&2; exit 1; }
staging_version="v0.${K8S_VERSION#v1.}"
edits=(-require="k8s.io/kubernetes@$K8S_VERSION")
for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod"); do
    # A few sample modules are not published for every release; nothing built here needs them.
    if go list -m "$m@$staging_version" >/dev/null 2>&1; then
        edits+=(-replace="$m=$m@$staging_version")
    else
        echo "k8s-binaries: $m@$staging_version is not published; not replaced (unused)" >&2
    fi
done
go mod edit "${edits[@]}"
cat > tools.go <<'EOF'
//go:build tools

// The commands built from this throwaway module.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
timed "module graph (go mod tidy)" go mod tidy

# The version the binaries report: Helm and kubectl compare it with charts and clients.
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
vflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    vflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    vflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
build() {  # build NAME PACKAGE [extra ldflags]
    timed "$1" nice -n 10 go build -p "$jobs" -trimpath -ldflags="-s -w ${3:-}" \
        -o "$work/out/bin/$1" "$2"
}
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$vflags"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$vflags"
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$vflags"
build kubectl k8s.io/kubernetes/cmd/kubectl "$vflags"
build etcd go.etcd.io/etcd/server/v3
etcd_version=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)

# --- helm: an ordinary module, `go install`-able as is --------------------------------------
timed helm env GOBIN="$work/out/bin" nice -n 10 go install -p "$jobs" -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"

cat > "$work/out/BUILD-INFO" <<EOF
kubernetes $K8S_VERSION
etcd $etcd_version
helm $HELM_VERSION
go $(go env GOVERSION)
build_seconds $(( $(date +%s) - started ))
EOF
rm -rf "$dest"
mv "$work/out" "$dest"
echo "k8s-binaries: done in $(( $(date +%s) - started )) s: $dest/bin" >&2
echo "$dest/bin"
