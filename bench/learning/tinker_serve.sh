# Sourced by the tinker_*.sh recipes (after they set OUT and PORT): resolves SmolLM2-135M's
# local folder as MODEL, starts `looprl serve-tinker` on PORT with its store in OUT/store
# (stopped when the script exits), waits until it answers, and points the SDK at it.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${VENV:-$ROOT/.venv}               # looprl's environment (make setup)
TK_VENV=${TK_VENV:-$ROOT/.venv-tinker}  # the cookbook's (make setup-tinker)
MODEL=$("$VENV/bin/python" -c "from looprl.model.load import resolve; print(resolve('smollm2-135m')[0])")
mkdir -p "$OUT"
"$VENV/bin/python" -m looprl serve-tinker "$MODEL" --port "$PORT" --store "$OUT/store" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -s -o /dev/null "http://127.0.0.1:$PORT/api/v1/healthz"; do sleep 1; done
export TINKER_BASE_URL=http://127.0.0.1:$PORT TINKER_API_KEY=tml-local TINKER_TELEMETRY=0
