#!/usr/bin/env bash
# The demo run by `make demo` (expects the venv's bin on PATH): a real fault-tolerant run.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG="runs/demo-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$LOG"
echo "== aegis run: 3 pods of a real DDP job (gloo on CPU, embedded NATS, in-process master)"
echo "   rank 1 raises an exception at step 300 (a software fault: every rank restarts in place at"
echo "   once, forked warm); rank 0 dies with no traceback at step 360 (unexplained: the checks run)"
echo "   and node-1's GPU check is broken (injected): watch Aegis recover"
aegis run --nodes 3 --spare-nodes 1 --max-retry 2 --job demo --view plain \
  --log-dir "$LOG" --status-file "$LOG/status.json" --inject-fault node-1:gpu \
  -- python examples/train_ddp.py --steps 400 --ckpt-every 10 --ckpt-dir "$LOG/ckpt" \
     --crash-at-step 300 --crash-rank 1 --exit-at-step 360 --exit-rank 0 --step-time-s 0.05
echo
echo "== the ranks resumed from their checkpoint (the crash line, then each rank's resume):"
grep -h "crashing at\|resumed from" "$LOG"/pods/*.log | sort || true
echo
echo "== aegis status and incidents (from the run's log directory)"
aegis status demo --log-dir "$LOG"
aegis incidents demo --log-dir "$LOG" | head -40
echo
echo "== aegis replay: the master's decisions, re-derived from its event log"
aegis replay "$LOG/events.jsonl" --json | python examples/summarize_replay.py
echo
echo "== aegis verify: every reachable state of the state machine that made those decisions"
aegis verify --workers 3 --max-retry 2
