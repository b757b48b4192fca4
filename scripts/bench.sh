#!/usr/bin/env bash
# Runs the benchmark (release build) against PostgreSQL, MariaDB and NATS JetStream on loopback,
# starting them (installing if needed) first. `--quick` is the CI smoke test; without it, the figures for BENCHMARKS.md.
# The smoke test's figures are never read, so it runs a debug build: after the tests' build, minutes
# cheaper than a release one.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_toolchain
use_demo_services
ensure_mariadb
# Plain TCP on loopback, as every figure in BENCHMARKS.md before TLS was built in: PostgreSQL's default
# sslmode (prefer) would encrypt wherever the server offers it.
export DATABASE_URL="$DATABASE_URL?sslmode=disable"
profile=--release
if [[ " $* " == *" --quick "* ]]; then
    profile=--profile=dev
fi
under_suite_lock cargo run --quiet "$profile" -p outbox-demo -- bench "$@"
