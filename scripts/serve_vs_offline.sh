#!/usr/bin/env bash
# Serving against the engine offline, on one workload: 64 requests of 128 prompt tokens
# and 128 generated tokens (EOS ignored). Runs `pagedllm bench throughput` (offline), then
# starts `pagedllm serve` and sends the same load with `pagedllm bench serve` at
# concurrency 64 and 1, optionally against a second server too (COMPARE_URL, e.g. a
# llama-server on :8081). Engine options (e.g. --quantization int8) come from the
# arguments. Writes bench-out/serve-vs-offline/ and prints the ratios.
#   scripts/serve_vs_offline.sh [--quantization int8]
set -euo pipefail
OUT=${OUT:-bench-out/serve-vs-offline}
PORT=${PORT:-8011}
BIN=${BIN:-.venv/bin}
mkdir -p "$OUT"
WORKLOAD=(--workload fixed --num-prompts 64 --prompt-len 128 --output-len 128)
"$BIN/pagedllm" bench throughput --policies paged "${WORKLOAD[@]}" --kv-cache-tokens 20480 \
  --max-model-len 2048 "$@" --out "$OUT/offline" | tail -4
# The offline batch-1 decode step, for the single stream's time per output token: 128
# steps after a 128-token prompt, the contexts a served request's tokens are made at.
"$BIN/pagedllm" bench decode --batch-sizes 1 --no-hf --steps 128 "$@" --out "$OUT/decode1" | tail -3
"$BIN/pagedllm" serve --port "$PORT" --kv-cache-memory 1GiB --no-prefix-caching "$@" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
COMPARE=()
if [ -n "${COMPARE_URL:-}" ]; then COMPARE=(--compare-url "$COMPARE_URL"); fi
"$BIN/pagedllm" bench serve --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" \
  --max-concurrency 64 --out "$OUT/serve64" "${COMPARE[@]}" | tail -30
"$BIN/pagedllm" bench serve --url "http://127.0.0.1:$PORT" --workload fixed --num-prompts 8 \
  --prompt-len 128 --output-len 128 --max-concurrency 1 --seed 1 --out "$OUT/serve1" \
  "${COMPARE[@]}" | tail -30
"$BIN/python" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline/throughput.json"))["results"][0]
serve = json.load(open(f"{out}/serve64/serve.json"))["summary"]
ours, base = serve["output_throughput"], offline["generated_tokens_per_s"]
print(f"concurrency 64: serving {ours:.1f} generated tok/s, offline {base:.1f}: {ours / base:.1%}")
step = json.load(open(f"{out}/decode1/decode.json"))["results"][0]["pagedllm_ms"]
serve1 = json.load(open(f"{out}/serve1/serve.json"))
tpot = next(r for r in serve1["latency"] if r["metric"] == "TPOT")
print(f"concurrency 1: TPOT {tpot['mean_ms']:.1f} ms, offline batch-1 step {step:.1f} ms: "
      f"{tpot['mean_ms'] / step:.2f}x")
PY
