#!/usr/bin/env bash
# Builds the Dockerfile's two images (operator, trainer) with buildah, as root, on a machine
# without Docker:   scripts/build-images.sh [operator|trainer ...]
# Bases: the Dockerfile's real ones when CEPHALO_BASES=real; by default (CEPHALO_BASES=standin)
# stand-ins made from Debian's packages (scripts/standin-bases.sh says how they differ),
# passed as build args: the Dockerfile keeps its real bases as defaults.
# Everything is cached outside the repo in $CEPHALO_IMAGE_CACHE (default
# ~/.cache/cephalo-images): buildah's storage, the stand-ins (keyed by their recipe), each
# image's locked dependencies (the Dockerfile's <image>-deps stages, found in buildah's layer
# cache: after a code change only the project is installed again) and each image (keyed by
# its build context, Dockerfile, base and build args), so a second run with nothing changed
# builds nothing. Only what the newest images are made of is kept; older builds are removed.
# Per image it writes $CACHE/out/<image>.json (digest, size, build seconds, the storage) and
# <image>.cdx.json (CycloneDX SBOM of its Python packages).
# Reproducible: SOURCE_DATE_EPOCH (default: the last commit's time) is every layer's file
# and creation time (--timestamp) and makes pip's bytecode hash-checked; the dependency
# layers are stamped DEPS_EPOCH instead, so they are the same whichever commit built them
# first, and the stand-ins STANDIN_EPOCH (scripts/standin-bases.sh); versions are locked.
# Storage: overlay where the kernel mounts it for buildah (layers share files), else vfs
# (every layer a full copy of the one below); CEPHALO_BUILDAH_DRIVER=overlay|vfs chooses.
# Env: REVISION and SOURCE_DATE_EPOCH (rebuild an older commit's image), CEPHALO_PIP_CA (a CA
# bundle for pip, passed as the pip-ca secret; default: the system bundle when it exists),
# PIP_INDEX_URL (a mirror), CEPHALO_REBUILD=1 (ignore the image cache), CEPHALO_TAG_PREFIX
# (default localhost/cephalo; images are tagged $CEPHALO_TAG_PREFIX-operator:<version>).
# Exit status: 0 built or cached; 1 a build failed; 2 bad use or no buildah; 3 the stand-in
# bases could not be made (Debian's or PyPI's packages out of reach: not the Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CEPHALO_IMAGE_CACHE:-$HOME/.cache/cephalo-images}
BASES=${CEPHALO_BASES:-standin}
PREFIX=${CEPHALO_TAG_PREFIX:-localhost/cephalo}
VERSION=$(python3 -I -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
REVISION=${REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
DEPS_EPOCH=315532800  # 1980-01-01, the earliest time a ZIP (a wheel) can hold
TARGETS=("${@:-operator trainer}")
read -r -a TARGETS <<<"${TARGETS[*]}"

die() { echo "build-images: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (buildah with chroot isolation)"
command -v buildah >/dev/null || die "no buildah: apt-get install -y buildah debootstrap"
mkdir -p "$CACHE/out" "$CACHE/bases"
# One build at a time per cache (two CI runs on one machine): the second waits, then finds
# the first one's images; removing older builds never races a build in flight.
exec 9>"$CACHE/lock"
flock 9

# overlay_works: buildah can mount an overlay container here (not inside every container).
overlay_works() {
    local probe="$CACHE/overlay-probe" c ok=1
    local P=(buildah --storage-driver overlay --root "$probe/storage" --runroot "$probe/run")
    rm -rf "$probe"
    c=$("${P[@]}" from scratch 2>/dev/null) && "${P[@]}" mount "$c" >/dev/null 2>&1 && ok=0
    "${P[@]}" rm -a >/dev/null 2>&1 || true
    rm -rf "$probe" 2>/dev/null || true
    return $ok
}
DRIVER=${CEPHALO_BUILDAH_DRIVER:-}
if [ -z "$DRIVER" ]; then
    if overlay_works; then DRIVER=overlay; else DRIVER=vfs; fi
fi
case $DRIVER in overlay | vfs) ;; *) die "CEPHALO_BUILDAH_DRIVER=$DRIVER: give overlay or vfs" ;; esac
STORAGE="$CACHE/$DRIVER"
B=(buildah --storage-driver "$DRIVER" --root "$STORAGE/storage" --runroot "$STORAGE/run")
# shellcheck source=scripts/standin-bases.sh
. scripts/standin-bases.sh

have_image() { "${B[@]}" inspect --type image "$1" >/dev/null 2>&1; }
sha() { sha256sum | cut -c1-16; }

# commit_rootfs DIR TAG: an image of a root filesystem, every file stamped STANDIN_EPOCH (the
# stand-ins are keyed by their recipe, not by a commit: the same recipe, the same stamps).
commit_rootfs() {
    local c
    c=$("${B[@]}" from scratch)
    "${B[@]}" add --quiet "$c" "$1.tar" /
    "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 "$c"
    "${B[@]}" commit --quiet --timestamp "$STANDIN_EPOCH" "$c" "$2" >/dev/null
    "${B[@]}" rm "$c" >/dev/null
}

# tar_rootfs DIR: a tar with sorted names, fixed owners' names and mtimes (reproducible).
tar_rootfs() {
    tar --sort=name --mtime="@$STANDIN_EPOCH" --numeric-owner --xattrs -C "$1" -cf "$1.tar" .
}

standin_bases() {
    local key tmp t0
    key=$(cat scripts/standin-bases.sh constraints/trainer.txt | sha)
    PYTHON_BASE=localhost/cephalo-standin-python:$key
    PYTORCH_BASE=localhost/cephalo-standin-pytorch:$key
    if ! have_image "$PYTHON_BASE" || ! have_image "$PYTORCH_BASE"; then
        command -v debootstrap >/dev/null || die "no debootstrap: apt-get install -y debootstrap"
        t0=$SECONDS
        tmp="$CACHE/bases/$key"
        rm -rf "$tmp" && mkdir -p "$tmp"
        echo "build-images: stand-in bases $key (debootstrap $STANDIN_SUITE + torch)…"
        standin_rootfs "$tmp/python" ||
            { echo "build-images: debootstrap failed (Debian's packages out of reach?)" >&2; exit 3; }
        tar_rootfs "$tmp/python" && commit_rootfs "$tmp/python" "$PYTHON_BASE"
        standin_add_torch "$tmp/python" constraints/trainer.txt ||
            { echo "build-images: torch for the stand-in failed (PyPI out of reach?)" >&2; exit 3; }
        tar_rootfs "$tmp/python" && commit_rootfs "$tmp/python" "$PYTORCH_BASE"
        rm -rf "$tmp/python" "$tmp/python.tar"
        # An older recipe's stand-ins go (the images built on them go with the older builds).
        "${B[@]}" images --noheading --format '{{.Name}}:{{.Tag}}' |
            { grep -E '^localhost/cephalo-standin-(python|pytorch):' || true; } |
            { grep -v -E ":$key\$" || true; } |
            while read -r ref; do "${B[@]}" rmi "$ref" >/dev/null 2>&1 || true; done
        echo "build-images: stand-in bases made in $((SECONDS - t0)) s"
    fi
}

# forget_older_builds TARGET KEY: untag TARGET's images of other build keys, then remove every
# untagged image that no tagged one is made of (an older build's steps), so the storage holds
# the stand-ins, the newest images and their cached steps, not one more copy per commit.
forget_older_builds() {
    local ref
    "${B[@]}" images --noheading --format '{{.Name}}:{{.Tag}}' |
        { grep -E "^$PREFIX-$1(-deps)?:build-" || true; } | { grep -v -E ":build-$2\$" || true; } |
        while read -r ref; do "${B[@]}" rmi "$ref" >/dev/null 2>&1 || true; done
    python3 -I - "$STORAGE/storage" "$DRIVER" <<'EOF' | xargs -r "${B[@]}" rmi >/dev/null 2>&1 || true
import json, pathlib, sys
# The layer cache finds a step by an image whose top layer sits on the step before: keep the
# untagged images whose top layer a tagged image is built on, remove the rest.
store, driver = pathlib.Path(sys.argv[1]), sys.argv[2]
images = json.loads((store / f"{driver}-images" / "images.json").read_text())
layers = {l["id"]: l for l in json.loads((store / f"{driver}-layers" / "layers.json").read_text())}
kept: set[str] = set()
for image in images:
    layer = image.get("layer") if image.get("names") else None
    while layer and layer not in kept:
        kept.add(layer)
        layer = layers.get(layer, {}).get("parent")
print(*(i["id"] for i in images if not i.get("names") and i.get("layer") not in kept), sep="\n")
EOF
}

# The build context: exactly the files .dockerignore lets in (as a Docker client sends them).
context_key() {
    python3 -I - <<'EOF'
import fnmatch, hashlib, os
pats = [l.strip() for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
def ignored(path):
    parts, out = path.split("/"), False
    for raw in pats:
        p = raw.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch("/".join(parts[:i + 1]), p) or
               fnmatch.fnmatch("/".join(parts[:i + 1]), p.removeprefix("**/"))
               for i in range(len(parts))):
            out = not raw.startswith("!")
    return out
h, n, size = hashlib.sha256(), 0, 0
for d, dirs, files in os.walk("."):
    dirs.sort()
    for f in sorted(files):
        rel = os.path.join(d, f)[2:]
        if not ignored(rel):
            data = open(rel, "rb").read()
            h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
            n, size = n + 1, size + len(data)
print(h.hexdigest()[:16], n, size)
EOF
}

if [ "$BASES" = standin ]; then
    standin_bases
    BASE_ARGS=(--build-arg "PYTHON_IMAGE=$PYTHON_BASE" --build-arg "PYTORCH_IMAGE=$PYTORCH_BASE")
else
    PYTHON_BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
    PYTORCH_BASE=$(sed -n 's/^ARG PYTORCH_IMAGE=//p' Dockerfile)
    BASE_ARGS=()
fi
read -r CTX_KEY CTX_FILES CTX_BYTES < <(context_key)
echo "build-images: build context $CTX_FILES files, $((CTX_BYTES / 1024)) KiB; $DRIVER storage"
SECRET=()
CA=${CEPHALO_PIP_CA-/etc/ssl/certs/ca-certificates.crt}
[ -n "$CA" ] && [ -s "$CA" ] && SECRET=(--secret "id=pip-ca,src=$CA")

for target in "${TARGETS[@]}"; do
    case $target in
        operator) base=$PYTHON_BASE ;;
        trainer) base=$PYTORCH_BASE ;;
        *) die "unknown target $target: operator or trainer" ;;
    esac
    base_id=$("${B[@]}" inspect --type image --format '{{.FromImageID}}' "$base" 2>/dev/null \
        || echo "$base")
    key=$(printf '%s\n' "$CTX_KEY" "$(sha256sum Dockerfile)" "$base_id" "$VERSION" "$REVISION" \
        "$SOURCE_DATE_EPOCH" "${PIP_INDEX_URL:-}" | sha)
    image="$PREFIX-$target:$VERSION"
    cached="$PREFIX-$target:build-$key"
    log="$CACHE/out/$target.build.log"
    t0=$SECONDS
    if [ "${CEPHALO_REBUILD:-0}" = 1 ] || ! have_image "$cached"; then
        echo "build-images: building $target on $base…"
        BUD=("${B[@]}" bud --isolation chroot --layers
            ${PIP_INDEX_URL:+--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL"}
            "${BASE_ARGS[@]}" "${SECRET[@]}")
        # The locked dependencies first, stamped DEPS_EPOCH: the image's own build below
        # finds these steps in the layer cache (whose lookup ignores --timestamp), so they
        # are the same layers whether this commit or an earlier one built them.
        "${BUD[@]}" --target "$target-deps" --timestamp "$DEPS_EPOCH" \
            -t "$PREFIX-$target-deps:build-$key" . >"$log" 2>&1 &&
        "${BUD[@]}" --target "$target" \
            --timestamp "$SOURCE_DATE_EPOCH" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
            --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
            -t "$cached" . >>"$log" 2>&1 ||
            { tail -30 "$log" >&2; echo "build-images: building $target failed (log: $log)" >&2; exit 1; }
        echo "build-images: $target: $(grep -c -- '--> Using cache' "$log" || true) steps from the layer cache"
        "${B[@]}" tag "$cached" "$image"
        forget_older_builds "$target" "$key"
        built=$((SECONDS - t0))
        # The SBOM, from the image's installed Python environment (run inside it).
        c=$("${B[@]}" from --quiet "$cached")
        "${B[@]}" run --isolation chroot --hostname localhost "$c" \
            /opt/cephalo/bin/python -I - "$image" <scripts/image_sbom.py >"$CACHE/out/$target.cdx.json"
        "${B[@]}" rm "$c" >/dev/null
    else
        "${B[@]}" tag "$cached" "$image"
        built=$(python3 -I -c 'import json,sys; print(json.load(open(sys.argv[1]))["build_seconds"])' \
            "$CACHE/out/$target.json")
    fi
    digest=$("${B[@]}" inspect --type image --format '{{.FromImageDigest}}' "$cached")
    size=$("${B[@]}" images --noheading --format '{{.Size}}' "$cached" | sed -n 1p)
    bytes=$(python3 -I - "$STORAGE/storage" "$DRIVER" \
        "$("${B[@]}" inspect --type image --format '{{.FromImageID}}' "$cached")" <<'EOF'
import json, sys, pathlib
# The image's uncompressed size: the sum of its layers' uncompressed sizes (buildah's
# layers.json), the figure a registry's "size" and the budget check use.
store, driver, wanted = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
image = next(i for i in json.loads((store / f"{driver}-images" / "images.json").read_text())
             if i["id"] == wanted)
layers = {l["id"]: l for l in json.loads((store / f"{driver}-layers" / "layers.json").read_text())}
total, layer = 0, layers.get(image["layer"])
while layer:
    total += layer.get("diff-size", 0)
    layer = layers.get(layer.get("parent", ""))
print(total)
EOF
)
    python3 -I - "$CACHE/out/$target.json" <<EOF
import json, sys
json.dump({"image": "$image", "base": "$base", "digest": "$digest", "bytes": $bytes,
           "build_seconds": $built, "context_files": $CTX_FILES, "context_bytes": $CTX_BYTES,
           "source_date_epoch": $SOURCE_DATE_EPOCH, "deps_epoch": $DEPS_EPOCH,
           "storage": {"driver": "$DRIVER", "root": "$STORAGE/storage",
                       "runroot": "$STORAGE/run"}}, open(sys.argv[1], "w"), indent=1)
EOF
    echo "build-images: $image $digest $((bytes / 1000000)) MB ($size), build $built s" \
         "(this run $((SECONDS - t0)) s), SBOM $CACHE/out/$target.cdx.json"
done
