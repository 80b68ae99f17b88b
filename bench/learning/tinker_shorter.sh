#!/bin/bash
# tinker-cookbook's preference/shorter recipe, unchanged, training SmolLM2-135M through
# `looprl serve-tinker` on this machine. Needs `make setup` and `make setup-tinker`.
#   bench/learning/tinker_shorter.sh [STEPS] [OUT]      (defaults: 30, runs/tinker_shorter)
# The recipe writes OUT/recipe/metrics.jsonl (one line a step: env/all/reward/total,
# .../format, .../win_minus_loss, .../ac_tokens_per_turn, time/total); the last line
# printed is the RESULT line of bench/.
set -euo pipefail
STEPS=${1:-30}
OUT=$(realpath -m "${2:-runs/tinker_shorter}")
PORT=${PORT:-8124}
source "$(dirname "$0")/tinker_serve.sh"  # MODEL, the server on PORT, the SDK pointed at it
"$TK_VENV/bin/python" -m tinker_cookbook.recipes.preference.shorter.train \
  model_name="$MODEL" renderer_name=qwen3_instruct \
  batch_size=4 group_size=4 max_tokens=48 learning_rate=3e-4 \
  max_steps="$STEPS" eval_every=0 \
  log_path="$OUT/recipe" behavior_if_log_dir_exists=delete > "$OUT/recipe.log" 2>&1
"$VENV/bin/python" - "$OUT/recipe/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "env/all/reward/total" in r]
print("step  reward  format  win_minus_loss  reply_tokens  step_s")
for r in rows:
    print(f"{r['step']:>4}  {r['env/all/reward/total']:+.3f}  {r['env/all/format']:.3f}"
          f"  {r['env/all/win_minus_loss']:+.3f}  {r['env/all/ac_tokens_per_turn']:.1f}"
          f"  {r['time/total']:.1f}")
first, last = rows[: len(rows) // 4 or 1], rows[-(len(rows) // 4 or 1) :]
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
median_s = sorted(r["time/total"] for r in rows[1:] or rows)[len(rows[1:] or rows) // 2]
print(f"RESULT steps={len(rows)} reward_first_quarter={mean(first, 'env/all/reward/total'):.3f} "
      f"reward_last_quarter={mean(last, 'env/all/reward/total'):.3f} "
      f"reply_tokens_first_quarter={mean(first, 'env/all/ac_tokens_per_turn'):.1f} "
      f"reply_tokens_last_quarter={mean(last, 'env/all/ac_tokens_per_turn'):.1f} "
      f"median_step_s={median_s:.1f}")
PY
