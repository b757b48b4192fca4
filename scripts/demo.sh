#!/usr/bin/env bash
# Runs the demo: starts (installing if needed) PostgreSQL on loopback, then the order service.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_postgres
ensure_database outbox_demo
export DATABASE_URL="$DATABASE_URL_BASE/outbox_demo"
cargo run --release -p outbox-demo "$@"
