#!/usr/bin/env bash
# Create the dynamic-security state of a new MCP Edge broker, non-interactively.
#
#   deploy/mosquitto/bootstrap.sh [--data-dir DIR] [--admin-user NAME] [--password-file FILE]
#                                 [--plugin PATH] [--owner USER]
#
# Writes DIR/dynamic-security.json (default DIR: /var/lib/mosquitto) holding one admin account
# (default name: admin) and default ACL access "deny" for publishClientSend,
# publishClientReceive, subscribe and unsubscribe, so an account can do only what its role
# lists. The admin password is read from FILE when it exists, else generated and written there
# (mode 0600; default FILE: DIR/dynsec-admin.password); the control plane logs in with it.
# Passwords never appear on a command line.
#
# Nothing changes when the dynamic-security file already exists (safe in a container entry
# point). The file is built in a private directory and moved into place only once a
# throw-away broker on a private Unix socket has applied and read back the defaults.
#
# Needs: mosquitto, mosquitto_ctrl and mosquitto_rr (Debian: mosquitto, mosquitto-clients).
set -euo pipefail
umask 077

data_dir=/var/lib/mosquitto
admin_user=admin
password_file=""
plugin="${MOSQUITTO_DYNSEC_PLUGIN:-}"
owner=""

die() { echo "bootstrap.sh: $*" >&2; exit 1; }
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --data-dir) data_dir="${2:?--data-dir needs a value}"; shift 2 ;;
    --admin-user) admin_user="${2:?--admin-user needs a value}"; shift 2 ;;
    --password-file) password_file="${2:?--password-file needs a value}"; shift 2 ;;
    --plugin) plugin="${2:?--plugin needs a value}"; shift 2 ;;
    --owner) owner="${2:?--owner needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

find_tool() {
  local found
  found=$(PATH="$PATH:/usr/sbin:/usr/local/sbin:/sbin" command -v "$1") \
    || die "$1 is not installed (Debian: apt-get install mosquitto mosquitto-clients)"
  echo "$found"
}
mosquitto=$(find_tool mosquitto)
mosquitto_ctrl=$(find_tool mosquitto_ctrl)
mosquitto_rr=$(find_tool mosquitto_rr)

if [ -z "$plugin" ]; then
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib/arm-linux-gnueabihf \
             /usr/lib /usr/lib64 /usr/local/lib /usr/local/lib64 /opt/homebrew/lib; do
    for candidate in "$dir/mosquitto_dynamic_security.so" "$dir/mosquitto/mosquitto_dynamic_security.so"; do
      if [ -f "$candidate" ]; then plugin=$candidate; break 2; fi
    done
  done
fi
[ -n "$plugin" ] && [ -f "$plugin" ] || die "mosquitto_dynamic_security.so not found; pass --plugin PATH"

if [ -z "$owner" ] && [ "$(id -u)" = 0 ] && id mosquitto >/dev/null 2>&1; then
  owner=mosquitto  # Debian's broker drops to this user and must be able to rewrite the file
fi
if [ ! -d "$data_dir" ]; then
  mkdir -p -m 0750 "$data_dir"
  # The plugin saves by writing a new file and renaming it: the broker needs the directory.
  if [ -n "$owner" ]; then chown "$owner" "$data_dir"; fi
fi
data_dir=$(cd "$data_dir" && pwd)
dynsec_file="$data_dir/dynamic-security.json"
password_file="${password_file:-$data_dir/dynsec-admin.password}"

if [ -e "$dynsec_file" ]; then
  echo "bootstrap.sh: $dynsec_file already exists; nothing to do" >&2
  exit 0
fi

if [ -s "$password_file" ]; then
  admin_password=$(head -n 1 "$password_file")
else
  admin_password=$(head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
  printf '%s\n' "$admin_password" > "$password_file.tmp"
  mv "$password_file.tmp" "$password_file"
fi
case "$admin_password" in
  *[[:space:]]*|"") die "the admin password in $password_file is empty or contains spaces" ;;
esac

# The socket lives in a short private directory (Unix socket paths are limited to ~100 bytes);
# the JSON is built next to its final place so the last step is an atomic rename.
work=$(mktemp -d "$data_dir/.bootstrap.XXXXXX")
sock_dir=$(mktemp -d "${TMPDIR:-/tmp}/mcp-dynsec.XXXXXX")
broker_pid=""
cleanup() {
  if [ -n "$broker_pid" ]; then kill "$broker_pid" 2>/dev/null || true; wait "$broker_pid" 2>/dev/null || true; fi
  rm -rf "$work" "$sock_dir"
}
trap cleanup EXIT

# 1. The admin account, its password read from stdin (mosquitto_ctrl asks twice).
printf '%s\n%s\n' "$admin_password" "$admin_password" \
  | "$mosquitto_ctrl" dynsec init "$work/dynamic-security.json" "$admin_user" >/dev/null \
  || die "mosquitto_ctrl dynsec init failed"

# 2. A broker reachable only through a private Unix socket applies the default ACL access.
cat > "$work/bootstrap.conf" <<CONF
per_listener_settings false
listener 0 $sock_dir/broker.sock
allow_anonymous false
plugin $plugin
plugin_opt_config_file $work/dynamic-security.json
persistence false
user $(id -un)
log_dest file $work/broker.log
CONF
"$mosquitto" -c "$work/bootstrap.conf" >/dev/null 2>&1 &
broker_pid=$!
for _ in $(seq 1 200); do
  [ -S "$sock_dir/broker.sock" ] && break
  kill -0 "$broker_pid" 2>/dev/null || die "the bootstrap broker exited: $(cat "$work/broker.log" 2>/dev/null)"
  sleep 0.05
done
[ -S "$sock_dir/broker.sock" ] || die "the bootstrap broker did not open its socket"

# mosquitto_rr sends one raw plugin command batch and prints the answer. (Debian's 2.0.11
# `mosquitto_ctrl dynsec setDefaultACLAccess` sends nothing.) Its options file keeps the
# password off the command line.
mkdir "$work/config"
printf -- '-u %s\n-P %s\n' "$admin_user" "$admin_password" > "$work/config/mosquitto_rr"
dynsec() {
  XDG_CONFIG_HOME="$work/config" "$mosquitto_rr" --unix "$sock_dir/broker.sock" -W 10 \
    -t '$CONTROL/dynamic-security/v1' -e '$CONTROL/dynamic-security/v1/response' \
    -m "{\"commands\": [$1]}"
}
deny_all='{"command": "setDefaultACLAccess", "acls": [
  {"acltype": "publishClientSend", "allow": false},
  {"acltype": "publishClientReceive", "allow": false},
  {"acltype": "subscribe", "allow": false},
  {"acltype": "unsubscribe", "allow": false}]}'
answer=$(dynsec "$deny_all") || die "setDefaultACLAccess got no answer"
case "$answer" in *'"error"'*|'') die "setDefaultACLAccess refused: $answer" ;; esac

answer=$(dynsec '{"command": "getDefaultACLAccess"}') || die "getDefaultACLAccess got no answer"
denied=$(printf '%s' "$answer" | grep -o '"allow":false' | wc -l)
if [ "$denied" -ne 4 ] || printf '%s' "$answer" | grep -q '"allow":true'; then
  die "default ACL access is not deny for all four kinds: $answer"
fi

kill "$broker_pid"
wait "$broker_pid" 2>/dev/null || true
broker_pid=""

# 3. Into place.
# The password file stays with whoever ran this (0600): it belongs to the control plane.
if [ -n "$owner" ]; then chown "$owner" "$work/dynamic-security.json"; fi
mv "$work/dynamic-security.json" "$dynsec_file"

cat >&2 <<DONE
bootstrap.sh: created $dynsec_file
  admin account:  $admin_user (password in $password_file)
  default access: deny (publishClientSend, publishClientReceive, subscribe, unsubscribe)
Point mosquitto.conf's plugin_opt_config_file at it and start the broker.
DONE
