# Stand-in base images, made from Debian's packages and PyPI when the Dockerfile's real bases
# cannot be pulled (no registry). Sourced by scripts/build-images.sh; its hash keys the cache,
# so editing this file rebuilds the stand-ins.
#
# How each stand-in differs from the real base (what a build on it does NOT show):
# * python stand-in (for python:3.11.11-slim-bookworm): a Debian bookworm minbase rootfs
#   (debootstrap) with Debian's python3 3.11.2 in /usr/bin (the real base: CPython 3.11.11
#   built from source in /usr/local), Debian's pip 23.0.1 / venv / ensurepip
#   (python3-pip, python3-venv, python-is-python3) and ca-certificates. Same libc (bookworm),
#   same `python` command, same groupadd/useradd. Debian marks its Python externally managed
#   (PEP 668); the Dockerfile only installs into a venv, so that does not matter.
# * pytorch stand-in (for pytorch/pytorch:2.9.0-cuda12.6-cudnn9-runtime): the python stand-in
#   plus PyPI's torch 2.13.0 (the real base: torch 2.9.0 for CUDA 12.6 in a conda Python
#   under /opt/conda, with numpy and the CUDA 12.6 runtime libraries). PyPI has only the CUDA
#   13 build of torch for Linux; the lightest install that still imports on CPU is
#   `--no-deps` torch plus only the NVIDIA wheels its shared libraries link (DT_NEEDED:
#   cudart, cupti, cublas, cufft, cufile, curand, cusparse + nvJitLink, cusparseLt, nccl,
#   nvrtc, nvshmem, cudnn), without triton (torch.compile only), cusolver and nvtx (loaded
#   lazily, never on CPU) and without the files those libraries only dlopen on a GPU (cudnn's
#   engine libraries, static archives, headers). CUDA itself is never initialised: the
#   stand-in proves the CPU paths, not the GPU ones. No numpy in the base (the trainer's venv
#   installs the locked one; the real base's numpy is shadowed the same way).
# Packages are pinned where PyPI is the source; Debian's are bookworm's current point release
# (their versions are listed in the stand-in's cache folder, dpkg.txt).

STANDIN_SUITE=bookworm
STANDIN_EPOCH=315532800  # every file's time and the image's (1980-01-01; not a commit's)
STANDIN_MIRROR=${STANDIN_MIRROR:-http://deb.debian.org/debian}
STANDIN_DEBS=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
STANDIN_TORCH=(torch==2.13.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
    nvidia-cublas==13.1.1.3 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6
    nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.5.37
    nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.29.7 nvidia-cuda-nvrtc==13.0.88
    nvidia-nvshmem-cu13==3.4.5 nvidia-cudnn-cu13==9.20.0.48
    # torch's pure-Python requirements (versions: the trainer's lock)
    filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec)

# standin_rootfs DIR: the python stand-in's root filesystem.
standin_rootfs() {
    debootstrap --variant=minbase --include="$STANDIN_DEBS" "$STANDIN_SUITE" "$1" \
        "$STANDIN_MIRROR" >"$1.log" 2>&1 || { tail -20 "$1.log" >&2; return 1; }
    chroot "$1" dpkg-query -W -f '${Package}=${Version}\n' >"$(dirname "$1")/dpkg.txt"
    # No apt lists, caches or logs in the image (they only record when it was made).
    rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb \
        "$1"/var/cache/ldconfig/aux-cache "$1"/var/log/* "$1"/run/* "$1"/tmp/*
}

# standin_add_torch DIR CONSTRAINTS: torch for CPU use into the rootfs (from pip's cache
# where it has the wheels: the host's pip, same CPython 3.11 ABI).
standin_add_torch() {
    local site="$1/usr/local/lib/python3.11/dist-packages"
    python3 -I -m pip install -q --disable-pip-version-check --no-warn-script-location \
        --root-user-action=ignore --no-deps --no-compile --constraint "$2" --target "$site" \
        "${STANDIN_TORCH[@]}"
    (cd "$site/nvidia" && rm -f cudnn/lib/libcudnn_*.so.9 cu13/lib/*.a \
        cu13/lib/libnvrtc.alt.so.13 cu13/lib/libnvrtc-builtins.alt.so.13.0 \
        cu13/lib/libcufftw.so.12 cu13/lib/libnvblas.so.13 cu13/lib/libcufile_rdma.so.1 \
        cu13/lib/libnvperf_* cu13/lib/libpcsamplingutil.so cu13/lib/libcheckpoint.so \
        nvshmem/lib/*.a nvshmem/lib/*.bc \
        && find . -name include -type d -prune -exec rm -rf {} +)
    find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
}
