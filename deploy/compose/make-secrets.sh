#!/bin/sh
# Create the secrets deploy/compose/compose.yaml mounts, once, as random passwords in
# deploy/compose/secrets/ (kept when they exist; never committed: secrets/.gitignore).
#
#   admin_password          the control plane's first admin (web console and CLI login: admin)
#   postgres_password       the PostgreSQL account mcp
#   broker_admin_password   Mosquitto's dynamic-security admin, used by the control plane
#
# Without Swarm, compose bind-mounts a secret file with its own mode and owner, and three
# different accounts read them (the control plane's 10001, mosquitto's 1883, postgres' 999):
# the files are 0644 inside a 0700 directory, so on the host only you and root can reach them.
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
chmod 0700 secrets
printf '*\n' > secrets/.gitignore
for name in admin_password postgres_password broker_admin_password; do
  if [ -s "secrets/$name" ]; then
    echo "secrets/$name exists; kept"
    continue
  fi
  # 32 URL-safe characters: no spaces (bootstrap.sh refuses them), no quoting trouble.
  head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' > "secrets/$name.tmp"
  printf '\n' >> "secrets/$name.tmp"
  chmod 0644 "secrets/$name.tmp"
  mv "secrets/$name.tmp" "secrets/$name"
  echo "secrets/$name created"
done
