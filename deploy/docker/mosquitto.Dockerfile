# syntax=docker/dockerfile:1
# The MCP Edge broker: the official eclipse-mosquitto 2.0 image with our configuration
# (deploy/mosquitto/mosquitto.conf) and the dynamic-security bootstrap
# (deploy/mosquitto/bootstrap.sh) run on every start. Build from the repository root:
#
#   docker build -f deploy/docker/mosquitto.Dockerfile -t mcp-edge/mosquitto:dev .
#
# The broker admin password is read from /run/secrets/broker_admin_password (a compose secret or
# a Kubernetes Secret; DYNSEC_ADMIN_PASSWORD_FILE names another file); the control plane logs in
# with the same one.
FROM eclipse-mosquitto:2.0

# bootstrap.sh is a bash script; the image is Alpine (busybox sh only).
USER root
RUN apk add --no-cache bash

# mosquitto.conf is written for Debian; the image keeps the dynamic-security plugin in /usr/lib
# and its data (persistence, dynamic-security.json) under /mosquitto/data.
COPY deploy/mosquitto/mosquitto.conf /mosquitto/config/mosquitto.conf
RUN sed -i \
      -e 's|/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so|/usr/lib/mosquitto_dynamic_security.so|' \
      -e 's|/var/lib/mosquitto/|/mosquitto/data/|g' \
      /mosquitto/config/mosquitto.conf \
    && ! grep -q -e x86_64-linux-gnu -e /var/lib/mosquitto /mosquitto/config/mosquitto.conf \
    && install -d -o mosquitto -g mosquitto -m 0750 /mosquitto/data
COPY --chmod=0755 deploy/mosquitto/bootstrap.sh /usr/local/bin/mcp-dynsec-bootstrap
COPY --chmod=0755 deploy/docker/mosquitto-entrypoint.sh /usr/local/bin/mcp-mosquitto-entrypoint

VOLUME ["/mosquitto/data"]
# The image's mosquitto account (uid/gid 1883), not root: it owns /mosquitto/data.
USER 1883:1883
# MQTT, as mosquitto.conf's listener says.
EXPOSE 1883
# The broker accepts TCP connections (no account needed, so no password in the check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/1883"]
ENTRYPOINT ["mcp-mosquitto-entrypoint"]
