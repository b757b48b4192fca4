#!/usr/bin/env bash
# Makes sure PostgreSQL, MariaDB and NATS JetStream run on loopback, installing them with apt if missing.
# Sourced by demo.sh and test.sh. Needs root (or passwordless sudo) only when something must be
# installed or started. Exports DATABASE_URL_BASE (no database name), MYSQL_URL (no database name) and
# NATS_URL.
set -euo pipefail

PG_PORT=5432
MYSQL_PORT=3306
NATS_PORT=4222
PG_USER=root
PG_PASSWORD=outbox

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  echo "outbox: installing $* with apt" >&2
  as_root apt-get update -qq
  # Through `env`: sudo drops the caller's environment, and a package's prompt would hang unseen.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Rust from rustup (Debian's is older than the workspace's rust-version), and the C compiler and make that
# linking and jemalloc's build need: checked first, before minutes of installing services.
ensure_toolchain() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "outbox: cargo not found; install Rust with rustup (https://rustup.rs), then run this again" >&2
    return 1
  fi
  if ! command -v cc >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    apt_install build-essential
  fi
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Waits for a listener on port $1 (named $2 in the error) for $3 tenths of a second, 100 if not given.
wait_port() {
  for _ in $(seq 1 "${3:-100}"); do port_open "$1" && return 0; sleep 0.1; done
  echo "outbox: $2 did not start listening on 127.0.0.1:$1" >&2
  return 1
}

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! command -v psql >/dev/null 2>&1; then
    apt_install postgresql postgresql-client
  fi
  if ! port_open "$PG_PORT"; then
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    echo "outbox: starting PostgreSQL $version" >&2
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
    wait_port "$PG_PORT" PostgreSQL
  fi
  # A fresh install only knows the 'postgres' superuser over the local socket: create our role once.
  if ! PGPASSWORD=$PG_PASSWORD psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -Atqc 'SELECT 1' >/dev/null 2>&1; then
    echo "outbox: creating PostgreSQL role $PG_USER" >&2
    as_root su postgres -c "psql -qc \"CREATE ROLE $PG_USER SUPERUSER LOGIN PASSWORD '$PG_PASSWORD'\"" ||
      as_root su postgres -c "psql -qc \"ALTER ROLE $PG_USER SUPERUSER LOGIN PASSWORD '$PG_PASSWORD'\""
  fi
  export DATABASE_URL_BASE="postgres://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT"
}

# Creates database $1 if it does not exist.
ensure_database() {
  if [ "$(PGPASSWORD=$PG_PASSWORD psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -Atqc "SELECT 1 FROM pg_database WHERE datname = '$1'")" != 1 ]; then
    PGPASSWORD=$PG_PASSWORD psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -qc "CREATE DATABASE $1"
  fi
}

# MariaDB with root reachable over TCP without a password (Debian's default authenticates root by the
# local socket only: the tests connect as root@127.0.0.1, so that is allowed once).
ensure_mariadb() {
  if ! command -v mariadb >/dev/null 2>&1 || [ ! -x /usr/sbin/mariadbd ]; then
    apt_install mariadb-server mariadb-client
  fi
  if ! port_open "$MYSQL_PORT"; then
    echo "outbox: starting MariaDB" >&2
    as_root mkdir -p /run/mysqld
    as_root chown mysql:mysql /run/mysqld 2>/dev/null || true
    # Its own error log, as Debian's configuration keeps none and the start is in the background; a
    # crash recovery after an unclean stop may take a while on a small machine.
    local log=/var/log/mysql/outbox-start.log
    as_root mkdir -p /var/log/mysql
    as_root chown mysql: /var/log/mysql 2>/dev/null || true
    as_root start-stop-daemon --start --oknodo --background --chuid mysql --exec /usr/sbin/mariadbd -- \
      --bind-address=127.0.0.1 --port="$MYSQL_PORT" --log-error="$log"
    if ! wait_port "$MYSQL_PORT" MariaDB 600; then
      as_root tail -n 20 "$log" >&2 || true
      return 1
    fi
  fi
  if ! mariadb -h 127.0.0.1 -P "$MYSQL_PORT" -u root -e 'SELECT 1' >/dev/null 2>&1; then
    echo "outbox: letting MariaDB's root log in from 127.0.0.1 without a password" >&2
    as_root mariadb -u root -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket"
  fi
  export MYSQL_URL="mysql://root@127.0.0.1:$MYSQL_PORT"
}

# Drops the MySQL test databases (`outbox_t_` and a UUIDv7) of runs that began over three hours ago. A
# run still going (another checkout's suite, CI beside a developer's run) keeps its own: its tests'
# databases would vanish under them.
drop_old_mysql_test_databases() {
  local db now_ms created_ms
  now_ms=$(date +%s%3N)
  for db in $(mariadb -h 127.0.0.1 -P "$MYSQL_PORT" -u root -N -e "SHOW DATABASES LIKE 'outbox\_t\_%'"); do
    # A UUIDv7's first 48 bits are its creation time in ms since the epoch.
    created_ms=0
    if [[ ${db:9:12} =~ ^[0-9a-f]{12}$ ]]; then created_ms=$((16#${db:9:12})); fi
    if (( now_ms - created_ms > 3 * 3600 * 1000 )); then
      mariadb -h 127.0.0.1 -P "$MYSQL_PORT" -u root -e "DROP DATABASE \`$db\`"
    fi
  done
}

# Chromium and ChromeDriver for the operator page's browser test.
ensure_chromium() {
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    apt_install chromium chromium-driver
  fi
}

# Whether the NATS server on port $1 has JetStream on (its INFO line, sent on connecting, says so).
nats_has_jetstream() {
  local info
  info=$(timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1 && IFS= read -r line <&3 && echo \"\$line\"" 2>/dev/null) || true
  [[ $info == *'"jetstream":true'* ]]
}

# The nats-server binary, which the tests start on ports of their own.
ensure_nats_installed() {
  if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    apt_install nats-server
  fi
}

# A nats-server with JetStream on $NATS_PORT, for the demo and the bench.
ensure_nats() {
  ensure_nats_installed
  if ! port_open "$NATS_PORT"; then
    echo "outbox: starting nats-server with JetStream" >&2
    as_root mkdir -p /var/lib/nats-server
    as_root start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server || echo /usr/sbin/nats-server)" -- \
      -a 127.0.0.1 -p "$NATS_PORT" -js -sd /var/lib/nats-server -l /var/log/nats-server.log
    wait_port "$NATS_PORT" nats-server
  fi
  # Debian's package starts a service (where systemd runs) whose configuration has no JetStream, maybe
  # only just now, so that the start above found it running: turn JetStream on there rather than leave
  # a server on the port that cannot hold a stream.
  if ! nats_has_jetstream "$NATS_PORT"; then
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet nats-server 2>/dev/null; then
      echo "outbox: turning JetStream on in /etc/nats-server.conf and restarting nats-server" >&2
      as_root mkdir -p /var/lib/nats-server
      as_root chown nats: /var/lib/nats-server 2>/dev/null || true
      grep -q jetstream /etc/nats-server.conf ||
        echo 'jetstream { store_dir: "/var/lib/nats-server" }' | as_root tee -a /etc/nats-server.conf >/dev/null
      as_root systemctl restart nats-server
      for _ in $(seq 1 100); do nats_has_jetstream "$NATS_PORT" && break; sleep 0.1; done
    fi
    if ! nats_has_jetstream "$NATS_PORT"; then
      echo "outbox: the NATS server on 127.0.0.1:$NATS_PORT has no JetStream; restart it with -js" >&2
      return 1
    fi
  fi
  export NATS_URL="nats://127.0.0.1:$NATS_PORT"
}

# Runs a command as the only test or bench run on this machine: their databases, schemas and streams have
# fixed names (sqlx names a test's database after the test), and a second run would drop or fill the
# first one's. `flock -o`: the servers a test starts do not inherit the lock. A directory, not a file:
# one made by another user in sticky /tmp cannot be opened to create (fs.protected_regular), a
# directory is only read.
under_suite_lock() {
  local lock=/tmp/outbox-suite.lock.d
  mkdir -p "$lock" 2>/dev/null || true
  if ! flock -n -o "$lock" true; then
    echo "outbox: waiting for another test or bench run on this machine to end ($lock)" >&2
  fi
  flock -o "$lock" "$@"
}

# PostgreSQL and NATS running, and DATABASE_URL pointing at the demo's database (demo.sh, bench.sh).
use_demo_services() {
  ensure_postgres
  ensure_nats
  ensure_database outbox_demo
  export DATABASE_URL="$DATABASE_URL_BASE/outbox_demo"
}
