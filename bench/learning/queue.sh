#!/usr/bin/env bash
# Run learning benchmarks one after another (each alone on the CPU), then greedy evals.
#   bash bench/learning/queue.sh move_forced game_random extraction ...
set -u
for name in "$@"; do
  .venv/bin/python bench/learning/run.py "$name" > "runs/bench-$name.log" 2>&1
  echo "$(date +%T) $name rc=$? $(grep RESULT runs/bench-$name.log)"
done
