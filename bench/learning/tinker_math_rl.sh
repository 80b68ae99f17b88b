#!/bin/bash
# tinker-cookbook's math_rl recipe (env=arithmetic), unchanged, training SmolLM2-135M
# through `looprl serve-tinker` on this machine. Needs `make setup` and `make setup-tinker`.
#   bench/learning/tinker_math_rl.sh [STEPS] [OUT]      (defaults: 25, runs/tinker_math_rl)
# The recipe writes OUT/metrics.jsonl (one line a step: env/all/reward/total, .../correct,
# .../format, time/total); the last line printed is the RESULT line of bench/.
set -euo pipefail
STEPS=${1:-25}
OUT=$(realpath -m "${2:-runs/tinker_math_rl}")
PORT=${PORT:-8123}
source "$(dirname "$0")/tinker_serve.sh"  # MODEL, the server on PORT, the SDK pointed at it
"$TK_VENV/bin/python" -m tinker_cookbook.recipes.math_rl.train \
  env=arithmetic model_name="$MODEL" renderer_name=qwen3_instruct \
  loss_fn=importance_sampling group_size=4 groups_per_batch=8 learning_rate=3e-4 \
  lora_rank=16 max_steps="$STEPS" eval_every=0 save_every=0 \
  log_path="$OUT/recipe" behavior_if_log_dir_exists=delete > "$OUT/recipe.log" 2>&1
"$VENV/bin/python" - "$OUT/recipe/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "env/all/reward/total" in r]
print("step  reward  correct  format  step_s")
for r in rows:
    print(f"{r['step']:>4}  {r['env/all/reward/total']:+.3f}  {r['env/all/correct']:.3f}"
          f"  {r['env/all/format']:.3f}  {r['time/total']:.1f}")
first, last = rows[: len(rows) // 4 or 1], rows[-(len(rows) // 4 or 1) :]
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
median_s = sorted(r["time/total"] for r in rows[1:] or rows)[len(rows[1:] or rows) // 2]
print(f"RESULT steps={len(rows)} reward_first_quarter={mean(first, 'env/all/reward/total'):.3f} "
      f"reward_last_quarter={mean(last, 'env/all/reward/total'):.3f} "
      f"correct_first_quarter={mean(first, 'env/all/correct'):.3f} "
      f"correct_last_quarter={mean(last, 'env/all/correct'):.3f} median_step_s={median_s:.1f}")
PY
