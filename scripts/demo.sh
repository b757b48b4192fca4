#!/usr/bin/env bash
# Runs the demo: starts (installing if needed) PostgreSQL and NATS with JetStream on loopback, then the
# order service's live story (`outbox-demo run`). Extra arguments go to outbox-demo, e.g.
#   ./scripts/demo.sh status        ./scripts/demo.sh produce --orders 1000
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
ensure_toolchain
use_demo_services
cargo run --quiet --release -p outbox-demo -- "$@"
