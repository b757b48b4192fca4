#!/usr/bin/env bash
# Runs the benchmark (release build) against PostgreSQL, MariaDB and NATS JetStream on loopback,
# starting them (installing if needed) first. `--quick` is the CI smoke test; without it, the figures for BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_toolchain
use_demo_services
ensure_mariadb
under_suite_lock cargo run --quiet --release -p outbox-demo -- bench "$@"
