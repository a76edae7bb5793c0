#!/usr/bin/env bash
# The demo run by `make demo` (expects the venv's bin on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== aegis verify: every reachable state of the production state machine (3 workers, max_retry 2)"
aegis verify --workers 3 --max-retry 2
echo
echo "== aegis replay: the seed's worked example, status after each event"
aegis replay examples/traces/seed-worked-example.jsonl
