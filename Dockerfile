# syntax=docker/dockerfile:1.7
#
# Two images from one file (tests/chart/test_dockerfile.py checks this file statically):
#   docker build --target operator -t ghcr.io/cephalo/cephalo-operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/cephalo/cephalo-trainer:0.1.0 .
#
# Base images are pinned by tag; pin them by digest in your own registry mirror for
# bit-for-bit rebuilds. The trainer base uses CUDA 12.6 on purpose: PyTorch's CUDA 12.8+
# builds drop the Pascal kernels (P40, P100) that mixed clusters still run. For only newer
# GPUs: --build-arg PYTORCH_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG PYTORCH_IMAGE=pytorch/pytorch:2.9.0-cuda12.6-cudnn9-runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
# The non-root user of both images; trainer pods run as it (chart: operator.trainerRunAsUser).
ARG UID=1000

# ---------------------------------------------------------------- operator: build stage
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY operator/ operator/
# Sources only (setuptools maps every subpackage); torch is not installed and never imported.
COPY trainer/ trainer/
RUN python -I -m venv /opt/cephalo \
 && /opt/cephalo/bin/pip install ".[operator]" \
 && /opt/cephalo/bin/python -I -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && /opt/cephalo/bin/python -I -c "import cephalo.operator" \
 && /opt/cephalo/bin/python -I -m pip uninstall --yes pip

# ---------------------------------------------------------------- operator: final image
FROM ${PYTHON_IMAGE} AS operator
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

# ---------------------------------------------------------------- trainer: build stage
FROM ${PYTORCH_IMAGE} AS trainer-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY operator/ operator/
COPY trainer/ trainer/
# torch comes from the base image (its CUDA build): the venv sees it through system site
# packages, and a constraint pins it so pip can never swap it for another build.
RUN python -I -m venv --system-site-packages /opt/cephalo \
 && python -I -c "from importlib.metadata import version; print('torch==' + version('torch'))" > /tmp/torch.txt \
 && /opt/cephalo/bin/pip install --constraint /tmp/torch.txt ".[trainer]" \
 && /opt/cephalo/bin/python -I -c "import cephalo.trainer, torch" \
 && /opt/cephalo/bin/python -I -m pip uninstall --yes pip

# ---------------------------------------------------------------- trainer: final image
FROM ${PYTORCH_IMAGE} AS trainer
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
RUN groupadd --gid ${UID} cephalo \
 && useradd --uid ${UID} --gid ${UID} --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cephalo
COPY --from=trainer-build /opt/cephalo /opt/cephalo
ENV PATH=/opt/cephalo/bin:${PATH} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER ${UID}:${UID}
# 29500: torch.distributed rendezvous; 9400: per-rank /metrics (CEPHALO_METRICS_PORT).
EXPOSE 29500 9400
CMD ["python", "-m", "cephalo.trainer"]
