#!/usr/bin/env bash
# Serving against the engine offline, on one workload: 64 requests of 128 prompt tokens
# and 128 generated tokens (EOS ignored). Each round runs `pagedllm bench throughput`
# (offline), then sends the same load to one `pagedllm serve` with `pagedllm bench serve`
# at concurrency 64, then the offline batch-1 decode step, then one stream served; the
# rounds interleave the two sides so that the machine's drift (±15% between runs on two
# shared cores) hits both alike. Optionally the served loads go to a second server too
# (COMPARE_URL, e.g. a llama-server on :8081). Engine options (e.g. --quantization int8)
# come from the arguments. Writes bench-out/serve-vs-offline/ and prints each round's
# ratios and their medians.
#   ROUNDS=3 scripts/serve_vs_offline.sh [--quantization int8]
set -euo pipefail
OUT=${OUT:-bench-out/serve-vs-offline}
PORT=${PORT:-8011}
BIN=${BIN:-.venv/bin}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
WORKLOAD=(--workload fixed --num-prompts 64 --prompt-len 128 --output-len 128)
"$BIN/pagedllm" serve --port "$PORT" --kv-cache-memory 1GiB --no-prefix-caching "$@" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
COMPARE=()
if [ -n "${COMPARE_URL:-}" ]; then COMPARE=(--compare-url "$COMPARE_URL"); fi
for ROUND in $(seq 1 "$ROUNDS"); do
  R="$OUT/round$ROUND"
  "$BIN/pagedllm" bench throughput --policies paged "${WORKLOAD[@]}" --kv-cache-tokens 20480 \
    --max-model-len 2048 "$@" --out "$R/offline" | tail -4
  "$BIN/pagedllm" bench serve --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" \
    --max-concurrency 64 --out "$R/serve64" "${COMPARE[@]}" | tail -30
  # The offline batch-1 decode step, for the single stream's time per output token: 128
  # steps after a 128-token prompt, the contexts a served request's tokens are made at.
  "$BIN/pagedllm" bench decode --batch-sizes 1 --no-hf --steps 128 "$@" --out "$R/decode1" \
    | tail -3
  "$BIN/pagedllm" bench serve --url "http://127.0.0.1:$PORT" --workload fixed --num-prompts 8 \
    --prompt-len 128 --output-len 128 --max-concurrency 1 --seed 1 --out "$R/serve1" \
    "${COMPARE[@]}" | tail -30
done
"$BIN/python" - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
many, one = [], []
for r in range(1, rounds + 1):
    at = f"{out}/round{r}"
    offline = json.load(open(f"{at}/offline/throughput.json"))["results"][0]
    served = json.load(open(f"{at}/serve64/serve.json"))["summary"]["output_throughput"]
    rate = offline["generated_tokens_per_s"]
    # The mean step, as TPOT is a mean (a median would leave the slow steps out).
    step = json.load(open(f"{at}/decode1/decode.json"))["results"][0]["pagedllm_mean_ms"]
    serve1 = json.load(open(f"{at}/serve1/serve.json"))
    tpot = next(m for m in serve1["latency"] if m["metric"] == "TPOT")["mean_ms"]
    many.append(served / rate)
    one.append(tpot / step)
    print(f"round {r}: concurrency 64: serving {served:.1f} generated tok/s, offline "
          f"{rate:.1f}: {served / rate:.1%}; concurrency 1: TPOT {tpot:.1f} ms, offline "
          f"batch-1 step (mean) {step:.1f} ms: {tpot / step:.2f}x")
print(f"median of {rounds} round(s): concurrency 64 {statistics.median(many):.1%} of offline; "
      f"concurrency 1 TPOT {statistics.median(one):.2f}x the offline step")
PY
