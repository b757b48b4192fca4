#!/usr/bin/env bash
# Runs the whole test suite against real services: starts (installing if needed) PostgreSQL and MariaDB
# on loopback, installs nats-server (each NATS test starts its own) and Chromium and ChromeDriver for the
# operator page's browser test, then `cargo test --workspace` (or of the packages named with -p). Each
# PostgreSQL and MariaDB test gets its own fresh database; the shared behavioural tests run on a fresh
# SQLite file each as well.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_toolchain
ensure_postgres
ensure_mariadb
ensure_nats_installed
ensure_chromium
ensure_database outbox_test
drop_old_mysql_test_databases
# sslmode's default (prefer): the tests' databases go over TLS where the server offers it, as a
# user's would.
export DATABASE_URL="$DATABASE_URL_BASE/outbox_test"
# The whole workspace unless a package is named: cargo lets --workspace override -p.
workspace=--workspace
for arg in "$@"; do
    case "$arg" in -p | -p* | --package | --package=*) workspace= ;; esac
done
under_suite_lock cargo test $workspace "$@"
