# syntax=docker/dockerfile:1
# The pd-operator image: the kopf operator only. The `transfer` extra (torch, nixl) belongs to
# the engine images, not here: the operator installs the project's base dependencies only.
# The development tooling (devtools/, the `pd-dev` command) is outside the build context.
#
#   docker build -t pd-operator:0.1.0 .
#
# Stage 1 builds a wheel and installs it with its dependencies into a virtualenv; stage 2 copies
# only that virtualenv onto a fresh slim base, so no build tooling or source tree ships.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is built from (see .dockerignore): changes to tests or docs do not
# invalidate this layer.
COPY pyproject.toml ./
COPY operator/ operator/
COPY transfer/ transfer/
COPY contract/ contract/
# Base dependencies only: the wheel is installed without the `[transfer]` extra.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/venv/bin/pip install /wheels/pd_operator-*.whl
# Nothing installs packages at runtime: drop the installer from the virtualenv.
RUN /opt/venv/bin/pip uninstall --yes pip

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pd-operator" \
      org.opencontainers.image.description="Kubernetes operator for prefill/decode disaggregated LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
# The chart mounts the root filesystem read-only: bytecode is compiled at install time and
# never written at runtime; HOME points at the writable /tmp emptyDir.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# uid/gid 65532 ("nonroot" by the distroless convention). Numeric, so `runAsNonRoot` can be
# verified by the kubelet without a passwd entry.
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080 8081
# Exec form: the operator is PID 1 with no shell in between, so SIGTERM reaches kopf directly.
ENTRYPOINT ["pd-operator", "run"]
