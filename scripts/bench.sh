#!/usr/bin/env bash
# Runs the benchmark (release build) against PostgreSQL and NATS JetStream on loopback, starting them
# (installing if needed) first. `--quick` is the CI smoke test; without it, the figures for BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_postgres
ensure_nats
ensure_database outbox_demo
export DATABASE_URL="$DATABASE_URL_BASE/outbox_demo"
cargo run --quiet --release -p outbox-demo -- bench "$@"
