#!/bin/sh
# Entry point of mcp-edge/mosquitto (mosquitto.Dockerfile): create the dynamic-security state on
# the first start (deploy/mosquitto/bootstrap.sh does nothing when it exists, so this runs on
# every start), then run the broker in the foreground.
#
#   DYNSEC_ADMIN_PASSWORD_FILE  the admin account's password (default
#                               /run/secrets/broker_admin_password): the control plane logs in
#                               with the same file (broker_admin_password_file). bootstrap.sh
#                               uses it when it exists; it must, because it cannot be written back
#                               to a read-only secret mount.
#   DYNSEC_ADMIN_USER           the admin account's name (default admin).
#
# Runs as the image's mosquitto user; started as root it hands the files to mosquitto, as
# Debian's package does, and the broker drops to that user by itself.
set -eu

password_file=${DYNSEC_ADMIN_PASSWORD_FILE:-/run/secrets/broker_admin_password}
admin_user=${DYNSEC_ADMIN_USER:-admin}

if [ ! -s "$password_file" ]; then
  echo "mosquitto-entrypoint: $password_file is missing or empty; mount the broker admin" \
       "password there (or set DYNSEC_ADMIN_PASSWORD_FILE)" >&2
  exit 64
fi

owner_args=""
if [ "$(id -u)" = 0 ]; then owner_args="--owner mosquitto"; fi
# shellcheck disable=SC2086 # owner_args is empty or two words
/usr/local/bin/mcp-dynsec-bootstrap --data-dir /mosquitto/data --admin-user "$admin_user" \
  --password-file "$password_file" --plugin /usr/lib/mosquitto_dynamic_security.so $owner_args

exec /usr/sbin/mosquitto -c /mosquitto/config/mosquitto.conf
