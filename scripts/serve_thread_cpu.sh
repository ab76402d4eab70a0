#!/usr/bin/env bash
# CPU time each thread of `pagedllm serve` spends during a load of CONCURRENCY streams
# (default 1: 4 requests x 128 tokens; else CONCURRENCY requests x 128), from
# /proc/PID/task/*/stat (utime + stime), so that the event loop's share per token can be
# told from the engine's; and the CPU the load generator (`pagedllm bench serve`, on the
# same cores) spent per token, as it reports it (client_cpu_ms_per_token). Engine options
# come from the arguments (docs/serving.md).
#   [CONCURRENCY=64] scripts/serve_thread_cpu.sh [--quantization int8]
set -euo pipefail
PORT=${PORT:-8051}
BIN=${BIN:-.venv/bin}
CONCURRENCY=${CONCURRENCY:-1}
"$BIN/pagedllm" serve --port "$PORT" --kv-cache-memory 1GiB --no-prefix-caching "$@" \
  > /tmp/serve_thread_cpu.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
ticks() {  # tid-name ticks, one line per thread
  for t in /proc/$SERVER/task/*; do
    echo "$(basename "$t")-$(tr ' ' _ < "$t/comm") $(awk '{print $14 + $15}' "$t/stat")"
  done | sort
}
LOAD=(--url "http://127.0.0.1:$PORT" --workload fixed --prompt-len 128)
"$BIN/pagedllm" bench serve "${LOAD[@]}" --max-concurrency 1 --num-prompts 1 --output-len 8 \
  --out /tmp/warm > /dev/null
PROMPTS=$((CONCURRENCY > 1 ? CONCURRENCY : 4))
TOKENS=$((PROMPTS * 128))
ticks > /tmp/serve_thread_cpu.before
"$BIN/pagedllm" bench serve "${LOAD[@]}" --max-concurrency "$CONCURRENCY" --num-prompts \
  "$PROMPTS" --output-len 128 --seed 1 --out /tmp/serve_thread_cpu \
  | grep -E "^\| TPOT|^  (output_throughput|client_cpu_ms_per_token):"
ticks > /tmp/serve_thread_cpu.after
HZ=$(getconf CLK_TCK)
join /tmp/serve_thread_cpu.before /tmp/serve_thread_cpu.after | awk -v hz="$HZ" -v n="$TOKENS" \
  '{ms = ($3 - $2) * 1000 / hz; if (ms > 0) printf "%s %.0f ms CPU, %.2f ms per token\n", $1, ms, ms / n}'
