# Two images from one file (tests/chart/test_dockerfile.py checks this file statically):
#   docker build --target operator -t ghcr.io/cephalo/cephalo-operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/cephalo/cephalo-trainer:0.1.0 .
#
# No `# syntax=` line: nothing here needs more than the Dockerfile frontend built into
# BuildKit and buildah (RUN --mount=type=secret), so no frontend image is pulled.
# Python packages install under a lock (constraints/*.txt, refreshed by scripts/lock-deps.sh);
# base images are pinned by tag: pin them by digest in your registry mirror as well for
# bit-for-bit rebuilds (scripts/build-images.sh builds both images without Docker).
# Behind a package mirror or TLS interception, nothing here needs editing:
#   --build-arg PIP_INDEX_URL=https://mirror.example/simple  (no credentials: build args
#       stay in the build stage's history; put credentials in a pip.conf of your own)
#   --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt  (extra CA bundle, never in
#       a layer: BuildKit and buildah mount it for the pip step only) The trainer base uses CUDA 12.6 on purpose: PyTorch's CUDA 12.8+
# builds drop the Pascal kernels (P40, P100) that mixed clusters still run. For only newer
# GPUs: --build-arg PYTORCH_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG PYTORCH_IMAGE=pytorch/pytorch:2.9.0-cuda12.6-cudnn9-runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
# The non-root user of both images; trainer pods run as it (chart: operator.trainerRunAsUser).
ARG UID=1000

# ---------------------------------------------------------------- operator: dependencies
# The locked dependencies in a stage of their own, before any source is copied: the layer
# changes only with the lock or the base, so a rebuild after a code change reuses it from
# the layer cache (docker's and buildah's --layers) and installs the project alone.
FROM ${PYTHON_IMAGE} AS operator-deps
ARG PIP_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints/ constraints/
# A venv without pip (and so without the old setuptools a Python 3.11 venv seeds), filled by
# the base's pip with exactly the lock (pip's whole resolution of the extra, --no-deps) less
# the build backend ([build-system] requires: setuptools, wheel), which only builds the
# project's wheel. Bytecode is compiled hash-checked, not stamped with the install time.
RUN --mount=type=secret,id=pip-ca \
    { [ ! -s /run/secrets/pip-ca ] || export PIP_CERT=/run/secrets/pip-ca; } \
 && { [ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL; } \
 && python -I -m venv --without-pip /opt/cephalo \
 && grep -v -E '^(setuptools|wheel)==' constraints/operator.txt > /tmp/deps.txt \
 && PIP_CONSTRAINT=/src/constraints/operator.txt \
    python -I -m pip --python /opt/cephalo/bin/python install --no-deps --no-compile -r /tmp/deps.txt \
 && /opt/cephalo/bin/python -I -m compileall -q -j 0 --invalidation-mode checked-hash /opt/cephalo/lib

# ---------------------------------------------------------------- operator: build stage
FROM operator-deps AS operator-build
ARG PIP_INDEX_URL=""
# Set (scripts/build-images.sh does), it makes the bytecode pip compiles hash-checked, not
# stamped with the install time.
ARG SOURCE_DATE_EPOCH
COPY pyproject.toml README.md ./
COPY src/ src/
COPY operator/ operator/
# Sources only (setuptools maps every subpackage); torch is not installed and never imported.
COPY trainer/ trainer/
# The project alone (--no-deps: its dependencies are the lock above; `pip check` fails the
# build where the lock misses one). PIP_CONSTRAINT, not --constraint, also pins pip's
# isolated build backend.
RUN --mount=type=secret,id=pip-ca \
    { [ ! -s /run/secrets/pip-ca ] || export PIP_CERT=/run/secrets/pip-ca; } \
 && { [ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL; } \
 && PIP_CONSTRAINT=/src/constraints/operator.txt \
    python -I -m pip --python /opt/cephalo/bin/python install --no-deps ".[operator]" \
 && python -I -m pip --python /opt/cephalo/bin/python check \
 && /opt/cephalo/bin/python -I -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && /opt/cephalo/bin/python -I -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('pip', 'setuptools')))" \
 && /opt/cephalo/bin/python -I -c "import cephalo.operator"

# ---------------------------------------------------------------- operator: final image
FROM ${PYTHON_IMAGE} AS operator
# Global ARGs are only visible on FROM lines: re-declared to reach the LABEL below.
ARG PYTHON_IMAGE
ARG VERSION
ARG REVISION
ARG UID
LABEL org.opencontainers.image.title="cephalo-operator" \
      org.opencontainers.image.description="Cephalo Kubernetes operator: profiles GPU pools, plans uneven batches and FSDP shards, runs trainer pods" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/cephalo/cephalo" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
RUN groupadd --gid ${UID} cephalo \
 && useradd --uid ${UID} --gid ${UID} --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cephalo
COPY --from=operator-build /opt/cephalo /opt/cephalo
ENV PATH=/opt/cephalo/bin:${PATH} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER ${UID}:${UID}
# 8080: /metrics (CEPHALO_OPERATOR_METRICS_PORT); 8081: kopf's /healthz (--liveness).
EXPOSE 8080 8081
ENTRYPOINT ["kopf", "run"]
CMD ["--module=cephalo.operator", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz"]

# ---------------------------------------------------------------- trainer: dependencies
# As for the operator: exactly the lock first (--no-deps), in a layer a code change reuses.
# torch comes from the base image (its CUDA build): the venv sees it through system site
# packages, and a constraint pins it so pip can never swap it for another build. --no-deps
# also keeps pip from "completing" the base's torch: resolving it pulled torch's own CUDA
# wheels (triton, cusolver, ... 1.3 GB, unlocked) into the venv, over what the base provides.
# The venv has no pip of its own (uninstalling one would still leave the base's pip visible
# through the system site packages): the base's pip fills it.
FROM ${PYTORCH_IMAGE} AS trainer-deps
ARG PIP_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints/ constraints/
RUN --mount=type=secret,id=pip-ca \
    { [ ! -s /run/secrets/pip-ca ] || export PIP_CERT=/run/secrets/pip-ca; } \
 && { [ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL; } \
 && python -I -m venv --without-pip --system-site-packages /opt/cephalo \
 && python -I -c "from importlib.metadata import version; print('torch==' + version('torch'))" > /tmp/torch.txt \
 && grep -v -E '^(setuptools|wheel)==' constraints/trainer.txt > /tmp/deps.txt \
 && PIP_CONSTRAINT="/src/constraints/trainer.txt /tmp/torch.txt" \
    python -I -m pip --python /opt/cephalo/bin/python install --no-deps --no-compile -r /tmp/deps.txt \
 && /opt/cephalo/bin/python -I -m compileall -q -j 0 --invalidation-mode checked-hash /opt/cephalo/lib

# ---------------------------------------------------------------- trainer: build stage
FROM trainer-deps AS trainer-build
ARG PIP_INDEX_URL=""
# Set (scripts/build-images.sh does), it makes the bytecode pip compiles hash-checked, not
# stamped with the install time.
ARG SOURCE_DATE_EPOCH
COPY pyproject.toml README.md ./
COPY src/ src/
COPY operator/ operator/
COPY trainer/ trainer/
RUN --mount=type=secret,id=pip-ca \
    { [ ! -s /run/secrets/pip-ca ] || export PIP_CERT=/run/secrets/pip-ca; } \
 && { [ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL; } \
 && PIP_CONSTRAINT="/src/constraints/trainer.txt /tmp/torch.txt" \
    python -I -m pip --python /opt/cephalo/bin/python install --no-deps ".[trainer,tracking]" \
 && /opt/cephalo/bin/python -I -c "import cephalo.trainer, torch, mlflow, tensorboard"

# ---------------------------------------------------------------- trainer: final image
FROM ${PYTORCH_IMAGE} AS trainer
# Global ARGs are only visible on FROM lines: re-declared to reach the LABEL below.
ARG PYTORCH_IMAGE
ARG VERSION
ARG REVISION
ARG UID
LABEL org.opencontainers.image.title="cephalo-trainer" \
      org.opencontainers.image.description="Cephalo trainer and profiler: uneven-shard FSDP with layered gradient accumulation on mixed GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/cephalo/cephalo" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTORCH_IMAGE}"
# /work: the working directory, the one folder of the image uid 1000 may write (`cephalo run`
# creates runs/ there); the base's /workspace is root's. Pods write to /tmp, /dev/shm and
# their checkpoint volume only (read-only root filesystem).
RUN groupadd --gid ${UID} cephalo \
 && useradd --uid ${UID} --gid ${UID} --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cephalo \
 && mkdir -m 0755 /work && chown ${UID}:${UID} /work
COPY --from=trainer-build /opt/cephalo /opt/cephalo
ENV PATH=/opt/cephalo/bin:${PATH} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /work
USER ${UID}:${UID}
# 29500: torch.distributed rendezvous; 9400: per-rank /metrics (CEPHALO_METRICS_PORT).
EXPOSE 29500 9400
CMD ["python", "-m", "cephalo.trainer"]
