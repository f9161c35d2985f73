# syntax=docker/dockerfile:1
# The MCP Edge device agent (`mcp-agent run`): local inference over HTTP and gRPC, and the fleet
# session to the broker. Build from the repository root (docs/deployment.md):
#
#   docker build -f deploy/docker/agent.Dockerfile -t mcp-edge/agent:dev .
#   docker build -f deploy/docker/agent.Dockerfile --build-arg EXTRAS=tflite,grpc,openvino \
#       -t mcp-edge/agent:dev-openvino .                      # Intel hosts (intel-xeon profile)
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/docker/agent.Dockerfile .
#
# Extras (pyproject.toml [project.optional-dependencies]), chosen by EXTRAS:
#   tflite    ai-edge-litert: .tflite models, the first backend of the raspberry-pi and
#             generic-arm64 profiles (XNNPACK). Small, and wheels exist for amd64 and arm64.
#   grpc      grpcio + tritonclient: the CMD below serves gRPC (--grpc-port), which needs them.
#   openvino  NOT in the default image: the OpenVINO runtime adds a few hundred MB and helps only
#             on Intel CPUs (intel-xeon profile: OpenVINO first, onnxruntime CPU as fallback, so
#             that profile still runs without it). Build the -openvino tag above for those hosts.
#   onnxruntime (CPU) is a core dependency and always installed. GPUs (CUDA, TensorRT, Jetson)
#   need onnxruntime-gpu instead: not this image (docs/deployment.md, "Jetson").
# Versions are those of deploy/constraints.txt, the set the test suite passes with.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: the mcp-edge wheel and every dependency as wheels in /wheels -------------------
FROM ${PYTHON_IMAGE} AS builder
ARG EXTRAS=tflite,grpc
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
ARG EXTRAS=tflite,grpc
LABEL org.opencontainers.image.title="mcp-edge agent" \
      org.opencontainers.image.description="MCP Edge device agent: mcp-agent run" \
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
    && /opt/mcp-edge/bin/mcp-agent --version

# A fixed non-root account (uid/gid 10001), so volumes and Kubernetes securityContexts can name it.
RUN groupadd --system --gid 10001 mcp \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/mcp-agent \
       --no-create-home --shell /usr/sbin/nologin mcp \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/mcp-agent
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/mcp-entrypoint

# The state dir (enrollment, keys, installed models, engine caches): `mcp-agent enroll` and
# `mcp-agent run` both read MCP_STATE_DIR (their --state-dir), so one variable serves both.
ENV MCP_STATE_DIR=/var/lib/mcp-agent
VOLUME ["/var/lib/mcp-agent"]
WORKDIR /var/lib/mcp-agent
USER 10001:10001

# HTTP (Open Inference Protocol v2, /healthz, /readyz, /metrics): the agent's default port.
# gRPC (inference.GRPCInferenceService): chosen here, passed as --grpc-port below.
EXPOSE 8000 8001

# Liveness only: /readyz answers 503 until a model is loaded, which an enrolled agent waiting for
# its first deployment legitimately is. Python, because the slim image has no curl.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

# Enroll once before the first run (the state dir keeps the answer; a second enroll is a no-op):
#   docker run --rm -v agent-state:/var/lib/mcp-agent -e MCP_ENROLL_TOKEN=... \
#       mcp-edge/agent:dev enroll --server http://cp.example:8080
#   docker run -d -v agent-state:/var/lib/mcp-agent -p 8000:8000 -p 8001:8001 mcp-edge/agent:dev
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcp-entrypoint", "mcp-agent"]
CMD ["run", "--host", "0.0.0.0", "--grpc-port", "8001"]
