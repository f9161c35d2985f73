#!/bin/sh
# Entry point of the mcp-edge images (agent.Dockerfile, controlplane.Dockerfile), installed as
# /usr/local/bin/mcp-entrypoint: reads two secrets from files into the variables the programs
# read, so neither has to be written into the environment of a container definition, then
# runs its arguments (the image gives "mcp-agent" or "mcp-controlplane" and the CMD).
#
#   MCP_ENROLL_TOKEN_FILE  a file holding the enrollment token -> MCP_ENROLL_TOKEN, which
#                          `mcp-agent enroll --token` reads (enroll has no --token-file).
#   PGPASSWORD_FILE        a file holding the PostgreSQL password -> PGPASSWORD, which libpq
#                          (psycopg) uses when the database URL carries no password, so
#                          controlplane.toml can say postgresql://mcp@postgres:5432/mcp.
#
# A variable already set wins over its _FILE. Only these two names are read: every other
# MCP_*_FILE (MCP_ADMIN_PASSWORD_FILE, MCP_BROKER_ADMIN_PASSWORD_FILE, MCP_PASSWORD_FILE) is a
# real option that takes a path, and is left alone.
set -eu

read_secret() {  # read_secret VAR FILE: VAR=first line of FILE, exported
  if [ ! -r "$2" ]; then
    echo "mcp-entrypoint: $1_FILE=$2 is not a readable file" >&2
    exit 64
  fi
  value=$(head -n 1 "$2" | tr -d '\r\n')
  if [ -z "$value" ]; then
    echo "mcp-entrypoint: $2 ($1_FILE) is empty" >&2
    exit 64
  fi
  export "$1=$value"
}

if [ -n "${MCP_ENROLL_TOKEN_FILE:-}" ] && [ -z "${MCP_ENROLL_TOKEN:-}" ]; then
  read_secret MCP_ENROLL_TOKEN "$MCP_ENROLL_TOKEN_FILE"
fi
if [ -n "${PGPASSWORD_FILE:-}" ] && [ -z "${PGPASSWORD:-}" ]; then
  read_secret PGPASSWORD "$PGPASSWORD_FILE"
fi
unset value

exec "$@"
