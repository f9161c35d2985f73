# syntax=docker/dockerfile:1
# The MCP Edge control plane (`mcp-controlplane serve`): REST API, web console, TUF repository,
# broker accounts, telemetry ingestion and rollouts. Build from the repository root:
#
#   docker build -f deploy/docker/controlplane.Dockerfile -t mcp-edge/controlplane:dev .
#
# Extras: postgres (psycopg), for PostgreSQL, which two or more replicas need (they share one
# database; SQLite works for a single replica). Nothing else: the control plane serves no
# models, so tflite, grpc and openvino would only add weight.
# Versions are those of deploy/constraints.txt, the set the test suite passes with.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: the mcp-edge wheel and every dependency as wheels in /wheels -------------------
FROM ${PYTHON_IMAGE} AS builder
ARG EXTRAS=postgres
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# Only what the wheel is built from (pyproject.toml's package-dir folders, the README it names).
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY controlplane ./controlplane
COPY shared ./shared
COPY firmware_profiles ./firmware_profiles
COPY deploy/tooling ./deploy/tooling
COPY deploy/constraints.txt ./deploy/constraints.txt
RUN python -m pip wheel --wheel-dir /wheels -c deploy/constraints.txt "/src[${EXTRAS}]"

# ---- runtime: a venv in /opt/mcp-edge installed from those wheels only ---------------------
FROM ${PYTHON_IMAGE}
ARG EXTRAS=postgres
LABEL org.opencontainers.image.title="mcp-edge control plane" \
      org.opencontainers.image.description="MCP Edge control plane: mcp-controlplane serve" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/mcp-edge/bin:$PATH
# The wheels and the constraints are bind-mounted from the builder, so no layer keeps them.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=bind,from=builder,source=/src/deploy/constraints.txt,target=/tmp/constraints.txt \
    python -m venv /opt/mcp-edge \
    && /opt/mcp-edge/bin/pip install --no-index --find-links /wheels \
       -c /tmp/constraints.txt "mcp-edge[${EXTRAS}]" \
    && /opt/mcp-edge/bin/mcp-controlplane --version

# A fixed non-root account (uid/gid 10001), so volumes and Kubernetes securityContexts can name it.
# The data dir and its repository/ and keys/ exist in the image, owned by it, so a named volume
# mounted on any of them starts with that owner (replicas share repository/ and keys/:
# deploy/compose/compose.yaml). /var/lib/mcp-enroll is where a one-shot job may leave an
# enrollment token for agents (compose.yaml's enroll-token service).
RUN groupadd --system --gid 10001 mcp \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/mcp-controlplane \
       --no-create-home --shell /usr/sbin/nologin mcp \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/mcp-controlplane \
       /var/lib/mcp-controlplane/repository /var/lib/mcp-controlplane/keys \
    && install -d -o 10001 -g 10001 -m 0755 /var/lib/mcp-enroll
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/mcp-entrypoint

# The data dir (controlplane.toml, the TUF repository and its keys, SQLite when no PostgreSQL):
# `init`, `serve` and `keys` all read MCP_DATA_DIR (their --data-dir).
ENV MCP_DATA_DIR=/var/lib/mcp-controlplane
VOLUME ["/var/lib/mcp-controlplane"]
WORKDIR /var/lib/mcp-controlplane
USER 10001:10001

# REST API, web console (/ui/), /healthz, /readyz, /metrics, /repo/: the default port.
EXPOSE 8080

# /readyz: the database answers at the newest schema and every broker session is logged in
# (compose starts the agents once both replicas report healthy). Python: no curl in slim.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=4 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=4)"]

# Create the data dir, database, first admin and TUF repository once before the first serve:
#   docker run --rm -v cp-data:/var/lib/mcp-controlplane -v $PWD/admin.pw:/run/secrets/admin_password:ro \
#       mcp-edge/controlplane:dev init --admin-password-file /run/secrets/admin_password
#   docker run -d -v cp-data:/var/lib/mcp-controlplane -p 8080:8080 mcp-edge/controlplane:dev
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcp-entrypoint", "mcp-controlplane"]
CMD ["serve", "--listen", "0.0.0.0:8080"]
