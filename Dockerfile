# syntax=docker/dockerfile:1
#
# Durable Check container image.
#
#   docker build -t durable-check:0.1.0 .
#   docker run -p 4317:4317 -p 4318:4318 -p 9464:9464 durable-check:0.1.0
#
# Runs `durable-check serve` as uid 10001 on a root filesystem it never writes to: state
# and violations go to /var/lib/durable-check, scratch files to /tmp (both volumes), so
# the container runs with readOnlyRootFilesystem.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Build stage: the project wheel and every dependency wheel, resolved once.
FROM ${PYTHON_IMAGE} AS builder
# The project wheel compiles its hot modules to C (hatch_build.py): a C compiler in this
# stage only, and a build that fails rather than falling back to pure Python. Debian's
# release fixes the compiler's version; pinning a point release would break the build at
# the next security update of the base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DURABLE_CHECK_COMPILE=require
WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ./
COPY processor ./processor
COPY exporters ./exporters
COPY rules ./rules
# The shipped rules go into the wheel (processor/_shipped_rules); the postgres extra
# brings the PostgreSQL driver for the chart's mode=deployment.
RUN pip wheel --wheel-dir /wheels ".[postgres]"

# Runtime stage: the installed wheels and nothing else of the build.
FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="durable-check" \
      org.opencontainers.image.description="OpenTelemetry processor and trace-based checker: would your agent sessions survive a crash?" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

RUN groupadd --system --gid 10001 durable-check \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin durable-check

# Only the wheels of the build stage, pinned to this version, no index: the image
# holds exactly what the build resolved.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "durable-check[postgres]==${VERSION}"

COPY --chown=root:root --chmod=0644 config/container.yaml /etc/durable-check/config.yaml
RUN install -d -o 10001 -g 10001 -m 0750 /var/lib/durable-check

VOLUME ["/var/lib/durable-check", "/tmp"]
WORKDIR /var/lib/durable-check
USER 10001:10001

# OTLP/gRPC, OTLP/HTTP (and /healthz, /readyz), Prometheus metrics, and the operator view
# (off in config/container.yaml; ui.endpoint 0.0.0.0:4319 with a token turns it on).
EXPOSE 4317 4318 9464 4319

# slim has no curl: Python asks the HTTP receiver for /healthz (exit 1 on any failure).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:4318/healthz', timeout=4).status == 200 else 1)"]

ENTRYPOINT ["durable-check", "serve"]
CMD ["--config", "/etc/durable-check/config.yaml"]
