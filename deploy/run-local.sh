#!/usr/bin/env bash
# Three coordinator replicas and HAProxy on this machine, without containers: the topology of
# deploy/docker-compose.yml against the machine's own Postgres and Redis, and a NATS server of its own
# that requires TLS and an nkey, as the compose file's does (docs/deploy.md).
#
#   deploy/run-local.sh start     # replicas on 127.0.0.1:8091-8093, the load balancer on 127.0.0.1:8090
#   deploy/run-local.sh status    # /readyz of each replica and through the load balancer
#   deploy/run-local.sh stop      # stops what start started (its own pid files), nothing else
#   deploy/run-local.sh stop --purge   # …and drops the database and the run directory
#
# Then point nodes and consumers at the load balancer only:
#   darkbloom login --coordinator http://127.0.0.1:8090
#   darkbloom serve --coordinator http://127.0.0.1:8090
#
# Settings (environment): LB_PORT (8090), REPLICA_PORTS ("8091 8092 8093"), DATABASE (darkbloom_deploy,
# created when missing), PG_ADMIN_DSN (postgresql://postgres@127.0.0.1:5432/postgres), REDIS_URL
# (redis://127.0.0.1:6379/0), NATS_PORT (4223: its own nats-server, with the TLS and nkey files that
# deploy/nats-certs.sh generates into $RUN_DIR/nats), NATS_SERVER (the nats-server command; installed with
# apt-get when missing), NATS_URL (set: your own NATS instead of that one, its credentials in the URL or
# as DARKBLOOM_NATS_CREDS, DARKBLOOM_NATS_NKEY, DARKBLOOM_NATS_TLS_CA…), NATS_SUBJECT_PREFIX (darkbloom-deploy),
# DARKBLOOM_ADMIN_TOKEN (generated into $RUN_DIR/admin_token when unset), MIN_TRUST (hardware),
# RUN_DIR (${TMPDIR:-/tmp}/darkbloom-deploy: logs, pid files, each replica's DARKBLOOM_HOME),
# DARKBLOOM (the darkbloom command; default: on PATH, else the repository's .venv/bin/darkbloom).
# Any other coordinator setting can be given as its DARKBLOOM_<FLAG> variable: every replica reads it.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
LB_PORT=${LB_PORT:-8090}
read -r -a PORTS <<<"${REPLICA_PORTS:-8091 8092 8093}"
DATABASE=${DATABASE:-darkbloom_deploy}
PG_ADMIN_DSN=${PG_ADMIN_DSN:-postgresql://postgres@127.0.0.1:5432/postgres}
PG_BASE=${PG_ADMIN_DSN%/*}                                   # postgresql://postgres@127.0.0.1:5432
DATABASE_URL=${PG_BASE/postgresql:/postgresql+asyncpg:}/$DATABASE
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
NATS_PORT=${NATS_PORT:-4223}
OWN_NATS=$([ -n "${NATS_URL:-}" ] && echo no || echo yes)
NATS_URL=${NATS_URL:-nats://127.0.0.1:$NATS_PORT}
NATS_SERVER=${NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
NATS_SUBJECT_PREFIX=${NATS_SUBJECT_PREFIX:-darkbloom-deploy}
MIN_TRUST=${MIN_TRUST:-hardware}
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/darkbloom-deploy}
NATS_DIR=$RUN_DIR/nats
LB_URL=http://127.0.0.1:$LB_PORT
if [ -z "${DARKBLOOM:-}" ]; then
  DARKBLOOM=$(command -v darkbloom || echo "$ROOT/.venv/bin/darkbloom")
fi

say() { echo "run-local: $*" >&2; }
die() { say "$*"; exit 1; }

# --- helpers ---------------------------------------------------------------------------------

http_ok() { curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null; }

wait_http() {  # url pidfile what
  for _ in $(seq 1 300); do
    http_ok "$1" && return 0
    if [ -n "${2:-}" ] && ! kill -0 "$(cat "$2")" 2>/dev/null; then
      die "$3 exited; last lines of its log:
$(tail -20 "${2%.pid}.log")"
    fi
    sleep 0.2
  done
  die "$3 did not answer $1 within 60 s"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # pidfile name: SIGTERM, up to 30 s, then SIGKILL; only the pid this script wrote
  local pidfile=$1 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping $2 (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { say "$2 still running after 30 s: SIGKILL"; kill -KILL "$pid"; }
  fi
  rm -f "$pidfile"
}

psql_admin() { psql "$PG_ADMIN_DSN" -v ON_ERROR_STOP=1 -tAc "$1"; }

apt_install() {  # package
  say "$1 is missing: installing Debian's $1"
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1"; }
  elif command -v sudo >/dev/null 2>&1; then
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y "$1"
  else
    die "install $1 first: apt-get install -y $1"
  fi
}

need_haproxy() {
  command -v haproxy >/dev/null 2>&1 && return 0
  apt_install haproxy
  command -v haproxy >/dev/null 2>&1 || die "haproxy still missing after apt-get"
}

need_nats_server() {
  [ -x "$NATS_SERVER" ] && return 0
  apt_install nats-server
  NATS_SERVER=$(command -v nats-server || echo /usr/sbin/nats-server)
  [ -x "$NATS_SERVER" ] || die "nats-server still missing after apt-get"
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

nats_server_address() {  # the first server of NATS_URL, without scheme or credentials: host:port
  local server=${NATS_URL%%,*}
  server=${server#*://}
  server=${server##*@}
  server=${server%%/*}
  case $server in *:*) echo "$server" ;; *) echo "$server:4222" ;; esac
}

start_nats() {  # its own nats-server: TLS with a CA of its own, clients authenticated by an nkey
  "$HERE/nats-certs.sh" init "$NATS_DIR" 127.0.0.1 localhost
  if running "$RUN_DIR/nats.pid"; then say "NATS already running (pid $(cat "$RUN_DIR/nats.pid"))"; return 0; fi
  tcp_open 127.0.0.1 "$NATS_PORT" && die "port $NATS_PORT is taken: set NATS_PORT (or NATS_URL for your own NATS)"
  cat >"$NATS_DIR/nats.conf" <<CONF
# written by deploy/run-local.sh: TLS required, clients authenticate with an nkey (users.conf)
listen: 127.0.0.1:$NATS_PORT
tls {
  cert_file: "$NATS_DIR/server.pem"
  key_file: "$NATS_DIR/server-key.pem"
  timeout: 2
}
include ./users.conf
CONF
  say "starting NATS on 127.0.0.1:$NATS_PORT (TLS, nkey)"
  nohup "$NATS_SERVER" -c "$NATS_DIR/nats.conf" >"$RUN_DIR/nats.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/nats.pid"
  for _ in $(seq 1 100); do  # (its log, not a probe: a probe that closes before TLS is logged as an error)
    grep -q "Server is ready" "$RUN_DIR/nats.log" && return 0
    running "$RUN_DIR/nats.pid" || die "nats-server exited; last lines of its log:
$(tail -20 "$RUN_DIR/nats.log")"
    sleep 0.1
  done
  die "nats-server was not ready on 127.0.0.1:$NATS_PORT within 10 s; its log: $RUN_DIR/nats.log"
}

lb_env() {  # the variables deploy/haproxy.cfg reads
  export DARKBLOOM_LB_BIND=127.0.0.1:$LB_PORT
  local i
  for i in 1 2 3; do export "DARKBLOOM_REPLICA_$i=127.0.0.1:${PORTS[$((i - 1))]}"; done
  unset DARKBLOOM_LB_RESOLVER
}

# --- commands --------------------------------------------------------------------------------

start() {
  [ "${#PORTS[@]}" = 3 ] || die "REPLICA_PORTS must name three ports (deploy/haproxy.cfg has three servers)"
  [ -x "$DARKBLOOM" ] || die "no darkbloom command at $DARKBLOOM: 'pip install .' (or make install), or set DARKBLOOM"
  need_haproxy
  pg_isready -d "$PG_ADMIN_DSN" -q || die "Postgres does not answer at $PG_ADMIN_DSN (scripts/ensure_services.sh starts it)"
  redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1 || die "Redis does not answer at $REDIS_URL"
  mkdir -p "$RUN_DIR"
  local nats_flags=() nats_address
  if [ "$OWN_NATS" = yes ]; then
    need_nats_server
    start_nats
    nats_flags=(--nats-url "$NATS_URL" --nats-nkey "$NATS_DIR/coordinator.nk" --nats-tls-ca "$NATS_DIR/ca.pem")
  else
    nats_address=$(nats_server_address)
    tcp_open "${nats_address%:*}" "${nats_address##*:}" || die "NATS does not answer at $nats_address"
    export DARKBLOOM_NATS_URL=$NATS_URL  # it may hold a password: kept off the command line
  fi
  if [ -z "${DARKBLOOM_ADMIN_TOKEN:-}" ]; then
    [ -s "$RUN_DIR/admin_token" ] || (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RUN_DIR/admin_token")
    DARKBLOOM_ADMIN_TOKEN=$(cat "$RUN_DIR/admin_token")
  fi
  export DARKBLOOM_ADMIN_TOKEN  # read by every replica as --admin-token, kept off the command line

  if [ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")" != 1 ]; then
    say "creating database $DATABASE"
    psql_admin "CREATE DATABASE \"$DATABASE\"" >/dev/null
  fi

  # One replica first: it migrates the schema; the others start once it answers (two replicas
  # must not migrate an empty database at the same moment).
  local i port home pidfile
  for i in 1 2 3; do
    port=${PORTS[$((i - 1))]}
    home=$RUN_DIR/replica$i
    pidfile=$RUN_DIR/replica$i.pid
    if running "$pidfile"; then say "replica $i already running (pid $(cat "$pidfile"))"; continue; fi
    mkdir -p "$home"
    say "starting replica $i on 127.0.0.1:$port"
    # the URL users reach (device-login links, the console) is the load balancer's; the setting has
    # no flag, only its environment variable
    DARKBLOOM_HOME=$home DARKBLOOM_PUBLIC_URL=$LB_URL nohup "$DARKBLOOM" coordinator --host 127.0.0.1 --port "$port" \
      --database-url "$DATABASE_URL" --redis-url "$REDIS_URL" \
      "${nats_flags[@]}" --nats-subject-prefix "$NATS_SUBJECT_PREFIX" \
      --min-trust "$MIN_TRUST" \
      >"$RUN_DIR/replica$i.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    [ "$i" = 1 ] && wait_http "http://127.0.0.1:$port/health" "$pidfile" "replica $i"
  done
  for i in 2 3; do
    wait_http "http://127.0.0.1:${PORTS[$((i - 1))]}/health" "$RUN_DIR/replica$i.pid" "replica $i"
  done

  lb_env
  if running "$RUN_DIR/haproxy.pid"; then
    say "HAProxy already running (pid $(cat "$RUN_DIR/haproxy.pid"))"
  else
    haproxy -q -c -f "$HERE/haproxy.cfg" || die "deploy/haproxy.cfg does not check"
    say "starting HAProxy on $LB_URL"
    nohup haproxy -db -f "$HERE/haproxy.cfg" >"$RUN_DIR/haproxy.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/haproxy.pid"
  fi
  wait_http "$LB_URL/readyz" "$RUN_DIR/haproxy.pid" "HAProxy"

  # every replica hears the other two over NATS
  for _ in $(seq 1 100); do
    local all=1
    for port in "${PORTS[@]}"; do
      curl -fsS --max-time 2 "http://127.0.0.1:$port/readyz" 2>/dev/null | grep -q '"replicas":3' || all=0
    done
    [ "$all" = 1 ] && break
    sleep 0.2
  done
  status
  cat >&2 <<EOF

run-local: up. One URL for everything: $LB_URL
  admin token:  $RUN_DIR/admin_token (or \$DARKBLOOM_ADMIN_TOKEN)
  a node:       darkbloom login --coordinator $LB_URL && darkbloom serve --coordinator $LB_URL
  the API:      $LB_URL/v1  (console: $LB_URL/console/)
  NATS:         $(nats_status)
  logs:         $RUN_DIR/replica{1,2,3}.log, $RUN_DIR/haproxy.log, $RUN_DIR/nats.log (its own NATS)
  stop:         $0 stop   (add --purge to drop database $DATABASE)
EOF
}

status() {
  local i port
  for i in 1 2 3; do
    port=${PORTS[$((i - 1))]}
    printf 'replica %s  127.0.0.1:%s  %s\n' "$i" "$port" \
      "$(curl -sS --max-time 2 "http://127.0.0.1:$port/readyz" 2>&1 || true)"
  done
  printf 'HAProxy    127.0.0.1:%s  %s\n' "$LB_PORT" "$(curl -sS --max-time 2 "$LB_URL/readyz" 2>&1 || true)"
  printf 'NATS       %s\n' "$(nats_status)"
}

nats_status() {
  if [ "$OWN_NATS" != yes ]; then
    echo "yours, at $(nats_server_address)"
  elif running "$RUN_DIR/nats.pid"; then
    echo "127.0.0.1:$NATS_PORT  running (pid $(cat "$RUN_DIR/nats.pid")): TLS (CA $NATS_DIR/ca.pem), nkey $NATS_DIR/coordinator.nk"
  else
    echo "127.0.0.1:$NATS_PORT  not running"
  fi
}

stop() {
  stop_pidfile "$RUN_DIR/haproxy.pid" HAProxy
  local i
  for i in 3 2 1; do stop_pidfile "$RUN_DIR/replica$i.pid" "replica $i"; done
  stop_pidfile "$RUN_DIR/nats.pid" NATS  # last: a stopping replica says "leaving" on it
  if [ "${1:-}" = --purge ]; then
    say "dropping database $DATABASE and $RUN_DIR"
    psql_admin "DROP DATABASE IF EXISTS \"$DATABASE\" WITH (FORCE)" >/dev/null
    rm -rf "$RUN_DIR"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) shift; stop "$@" ;;
  status) status ;;
  restart) stop; start ;;
  *) echo "usage: $0 start|stop [--purge]|status|restart" >&2; exit 2 ;;
esac
