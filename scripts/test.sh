#!/usr/bin/env bash
# Runs the whole test suite against real services: starts (installing if needed) PostgreSQL and NATS on
# loopback, then `cargo test --workspace`. Each PostgreSQL test gets its own fresh database; the shared
# behavioural tests run once more on a fresh SQLite file each (no server needed for those).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_postgres
ensure_nats
ensure_database outbox_test
export DATABASE_URL="$DATABASE_URL_BASE/outbox_test"
cargo test --workspace "$@"
