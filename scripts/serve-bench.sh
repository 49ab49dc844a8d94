#!/usr/bin/env bash
# Load on `lantern serve` with wrk (Debian package `wrk`): requests/s and latency
# percentiles of GET /health and of a 1-token completion, under 64 concurrent connections.
#   scripts/serve-bench.sh [LANTERN_BINARY] [SECONDS]
# Compare two servers by running it once per binary, one after the other, on a quiet machine.
set -euo pipefail
bin="${1:-target/release/lantern}"
secs="${2:-10}"
port="${SERVE_BENCH_PORT:-18431}"
command -v wrk >/dev/null || { echo "serve-bench: needs wrk (apt-get install wrk)" >&2; exit 1; }
export WGPU_BACKEND="${WGPU_BACKEND:-vulkan}" NODEVICE_SELECT=1
model="$("$bin" fetch 2>/dev/null)"
log="$(mktemp)"
"$bin" serve --quiet --port "$port" --context 256 --max-seqs 8 --max-waiting 1024 --model "$model" --model-name m >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; rm -f "$log" "$lua"' EXIT
for _ in $(seq 1 300); do
    grep -q "listening on" "$log" && break
    sleep 0.2
done
lua="$(mktemp --suffix .lua)"
cat >"$lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}'
LUA
url="http://127.0.0.1:$port"
summary() { awk '/Requests\/sec/ {rps=$2} /^ +50%/ {p50=$2} /^ +99%/ {p99=$2} /Non-2xx/ {bad=$NF} /Socket errors/ {err=$0}
    END {printf "%10s req/s  p50 %8s  p99 %8s  non-2xx %s %s\n", rps, p50, p99, (bad==""?0:bad), err}'; }
printf "%-34s" "GET /health, 64 connections:"
wrk -t2 -c64 -d"${secs}s" --latency "$url/health" | summary
printf "%-34s" "1-token completion, 64 conns:"
wrk -t2 -c64 -d"${secs}s" --timeout 30s --latency -s "$lua" "$url/v1/completions" | summary
