#!/usr/bin/env bash
# Builds the images and runs deploy/compose.yaml for real: two Lantern replicas behind SGLang's
# gateway, in Docker. Checks that
#   1. the gateway answers chat completions through the replicas once both are healthy,
#   2. requests with different prompt prefixes reach both replicas (each replica's own
#      /metrics, read at its container address),
#   3. `docker stop` (SIGTERM) on a replica in the middle of a streamed answer lets that stream
#      finish with its [DONE] event, and the gateway then serves everything from the other one,
# then takes the deployment down (volumes included). Needs docker and docker-compose (v1 or
# the v2 plugin); the first build compiles Lantern inside the image (15-25 minutes on two
# cores). Without Docker Hub, build the base images first: deploy/offline-bases.sh.
#   deploy/check.sh            # MODEL=gemma3-270m deploy/check.sh for another model
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/deploy"
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
compose+=(-f compose.yaml -p lantern-check)
say() { echo "deploy/check: $*" >&2; }
fail() { say "FAILED: $*"; "${compose[@]}" logs --tail 30 >&2 || true; exit 1; }
cleanup() { "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

say "building the images"
t0=$(date +%s)
docker build -q -t lantern "$root" >/dev/null
docker build -q -t lantern-gateway -f gateway.Dockerfile . >/dev/null
say "images built in $(( $(date +%s) - t0 )) s: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^lantern(-gateway)?:latest ' | tr '\n' ' ')"

t0=$(date +%s)
"${compose[@]}" up -d >/dev/null 2>&1 || fail "compose up"
gateway=http://localhost:8000
chat() { # chat PROMPT [extra JSON fields]
    curl -s -m 120 "$gateway/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"smollm2\",\"max_tokens\":8,\"temperature\":0,\"messages\":[{\"role\":\"user\",\"content\":\"$1\"}]${2:-}}"
}
for _ in $(seq 1 120); do
    if chat "Hello" | grep -q '"chat.completion"'; then break; fi
    sleep 2
done
chat "Hello" | grep -q '"chat.completion"' || fail "the gateway never answered a chat completion"
say "first answer through the gateway $(( $(date +%s) - t0 )) s after compose up"

addr() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$("${compose[@]}" ps -q "$1")"; }
a="$(addr lantern-a)"; b="$(addr lantern-b)"
served() { # requests a replica finished, from its own metrics
    curl -s -m 10 "http://$1:8080/metrics" | awk '/^vllm:request_success_total/ {s += $2} END {print s + 0}'
}
# Different system prompts: the cache-aware policy keeps a prefix where its KV already is, and
# spreads new prefixes by load.
for i in $(seq 1 12); do
    chat "Topic $i: $(head -c 600 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c 200)" >/dev/null &
done
wait
na=$(served "$a"); nb=$(served "$b")
say "requests served: lantern-a $na, lantern-b $nb"
[ "$na" -gt 0 ] && [ "$nb" -gt 0 ] || fail "requests did not reach both replicas"

# Drain: a long stream on lantern-a (sent to it directly, so we know where it runs), then
# SIGTERM through docker stop while it streams.
stream="$(mktemp)"
curl -s -N -m 300 "http://$a:8080/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"smollm2","max_tokens":96,"temperature":0,"stream":true,"messages":[{"role":"user","content":"Write a long story."}]}' >"$stream" &
curl_pid=$!
for _ in $(seq 1 100); do grep -q '"delta"' "$stream" && break; sleep 0.2; done
grep -q '"delta"' "$stream" || fail "the stream on lantern-a never started"
t0=$(date +%s)
"${compose[@]}" stop -t 40 lantern-a >/dev/null 2>&1
wait "$curl_pid" || fail "the stream's connection failed while lantern-a drained"
tail -c 200 "$stream" | grep -q '\[DONE\]' || fail "the stream on lantern-a ended without [DONE]"
grep -q '"finish_reason":"length"' "$stream" || fail "the drained stream did not finish its 96 tokens"
say "lantern-a drained on SIGTERM: its stream finished (96 tokens, [DONE]); exited $(( $(date +%s) - t0 )) s after docker stop"
rm -f "$stream"

before=$(served "$b")
for i in 1 2 3 4; do
    chat "After the drain $i" | grep -q '"chat.completion"' || fail "the gateway lost a request after lantern-a stopped"
done
after=$(served "$b")
[ $((after - before)) -ge 4 ] || fail "lantern-b served $((after - before)) of the 4 requests after the drain"
say "after the drain lantern-b served all 4 requests through the gateway"
say "passed"
