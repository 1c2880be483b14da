# syntax=docker/dockerfile:1
# The warmloop image: agent worker, inference worker (a sidecar of each vLLM engine pod),
# CLI, gateway, approvals inbox and the metrics observer/relay. The vLLM engine itself
# runs vLLM's own image (infra/k8s/base/engine.yaml).
#
#   docker build -t warmloop:0.1.0 .        # or: buildah bud -t warmloop:0.1.0 .
#
# The base is pinned to an exact patch release; pin its digest too when you publish
# (`docker buildx imagetools inspect python:3.11.13-slim-bookworm`, then
# `--build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:...`).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build: a virtual environment with warmloop and its dependencies ------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/warmloop
# The package is `warmloop/`, whose rooms are links to the top-level folders.
COPY pyproject.toml README.md ./
COPY warmloop ./warmloop
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY infra ./infra
RUN /opt/warmloop/bin/pip install --no-cache-dir ./ \
    && /opt/warmloop/bin/python -c "import warmloop.workers.cli, warmloop.workers.observability"

# ---- runtime: the same base, the environment, an unprivileged user ---------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="warmloop" \
      org.opencontainers.image.description="Temporal orchestration for LLM agent jobs on a vLLM fleet" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 warmloop \
    && useradd --system --uid 10001 --gid warmloop --home-dir /home/warmloop \
       --create-home --shell /usr/sbin/nologin warmloop \
    && install -d -o 10001 -g 10001 /var/lib/warmloop
COPY --from=build /opt/warmloop /opt/warmloop
ENV PATH=/opt/warmloop/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WARMLOOP_STATE_DIR=/var/lib/warmloop \
    WARMLOOP_LOG_FORMAT=json
USER 10001:10001
WORKDIR /home/warmloop
# inbox, gateway, agent/inference worker metrics (loopback), relay, observer
EXPOSE 8300 8500 9465 9480
CMD ["warmloop", "--help"]
