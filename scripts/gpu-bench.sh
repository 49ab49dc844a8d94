#!/usr/bin/env bash
# Decode and prefill speed of the four catalogue models on a GPU, against the adapter's own
# buffer-copy bandwidth measured in the same run (and llama.cpp's Vulkan backend when
# LLAMA_BENCH names a llama-bench binary built with it).
#
#   scripts/gpu-bench.sh [OUT]        on a machine with the GPU, Rust and network: build,
#                                     fetch the models, measure, write OUT/gpu-bench.{md,json}
#   scripts/gpu-bench.sh pack DIR     here: the release binary and the four models' GGUF
#                                     headers (a few MB each) into DIR, for a GPU machine
#                                     without network or Rust
#   scripts/gpu-bench.sh run DIR [OUT]  there: rebuild each model from its header with
#                                     generated weights (`lantern synth`: same tensor types
#                                     and shapes, so the same bytes are read) and measure
#
# Each model: three cold `lantern run` processes (128-token prompt, 128 tokens decoded,
# --ignore-eos), medians of prefill tokens/s, decode tokens/s and TPOT, the host's busy time
# per token, and the weights' read bandwidth (weight bytes x tokens/s) as a fraction of the
# copy bandwidth; one more run with --decode-ahead 0 (a step at a time) beside it.
# Environment: LANTERN_GPU_BACKEND (default vulkan), LANTERN_GPU_ADAPTER (index or name),
# LLAMA_BENCH (path to llama-bench), GPU_BENCH_TOKENS (default 128), GPU_BENCH_RUNS (3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
models=(smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b)
backend="${LANTERN_GPU_BACKEND:-vulkan}"
tokens="${GPU_BENCH_TOKENS:-128}"
runs="${GPU_BENCH_RUNS:-3}"
export NODEVICE_SELECT=1

build() {
    # shellcheck source=setup.sh
    source "$root/scripts/setup.sh"
    cargo build --quiet --release --manifest-path "$root/Cargo.toml" --bin lantern
}

# bench LANTERN OUT FILE...: measure each model file, write OUT/gpu-bench.{json,md}.
bench() {
    local lantern="$1" out="$2"
    shift 2
    mkdir -p "$out"
    local adapter=()
    [ -n "${LANTERN_GPU_ADAPTER:-}" ] && adapter=(--adapter "$LANTERN_GPU_ADAPTER")
    "$lantern" devices --backend "$backend" --bandwidth --json > "$out/devices.json"
    # A 128-token prompt for every tokenizer: plain English prose.
    local prompt
    prompt="$(for _ in $(seq 12); do printf 'The quick brown fox jumps over the lazy dog near the river bank. '; done)"
    : > "$out/runs.jsonl"
    for f in "$@"; do
        local name
        name="$(basename "$f")"
        for ahead in 3 0; do
            local n="$runs"
            [ "$ahead" = 0 ] && n=1
            for i in $(seq "$n"); do
                echo "gpu-bench: $name, run $i of $n, decode-ahead $ahead" >&2
                "$lantern" run --model "$f" "$prompt" --max-tokens "$tokens" --ignore-eos --decode-ahead "$ahead" \
                    --backend "$backend" "${adapter[@]}" --json 2>/dev/null \
                    | python3 -c "import json,sys; j=json.load(sys.stdin); j['file']='$name'; j['ahead']=$ahead; j.pop('text',None); j.pop('output_ids',None); print(json.dumps(j))" \
                    >> "$out/runs.jsonl"
            done
        done
        if [ -n "${LLAMA_BENCH:-}" ]; then
            echo "gpu-bench: $name, llama-bench" >&2
            "$LLAMA_BENCH" -m "$f" -p 128 -n "$tokens" -o json 2>/dev/null \
                | python3 -c "import json,sys; print(json.dumps({'file': '$name', 'llama_bench': json.load(sys.stdin)}))" >> "$out/runs.jsonl" || true
        fi
    done
    python3 - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
devices = json.load(open(f"{out}/devices.json"))
runs = [json.loads(l) for l in open(f"{out}/runs.jsonl")]
med = lambda v: statistics.median(v) if v else float("nan")
rows, summary = [], []
for name in dict.fromkeys(r["file"] for r in runs):
    rs = [r for r in runs if r["file"] == name and r.get("ahead") == 3]
    step = [r for r in runs if r["file"] == name and r.get("ahead") == 0]
    lb = [r["llama_bench"] for r in runs if r["file"] == name and "llama_bench" in r]
    if not rs:
        continue
    adapter = rs[0]["adapter"]["name"]
    copy = next((d.get("copy_gbps") for d in devices if d["name"] == adapter), None)
    wb = rs[0]["weight_bytes"]
    tps = med([r["tokens_per_s"] for r in rs])
    gbps = wb * tps / 1e9
    lb_tg = next((t.get("avg_ts") for t in (lb[0] if lb else []) if t.get("n_gen", 0) > 0), None)
    lb_pp = next((t.get("avg_ts") for t in (lb[0] if lb else []) if t.get("n_prompt", 0) > 0), None)
    s = {
        "model": name, "adapter": adapter, "weight_mb": wb / 1e6,
        "prefill_tok_s": med([r["prefill_tokens_per_s"] for r in rs]),
        "decode_tok_s": tps, "tpot_ms": med([r["tpot_ms"] for r in rs]),
        "host_busy_ms_per_token": med([r["host"]["busy_ms_per_token"] for r in rs if r.get("host")]),
        "decode_gbps": gbps, "copy_gbps": copy, "fraction_of_copy": gbps / copy if copy else None,
        "step_at_a_time_tok_s": med([r["tokens_per_s"] for r in step]),
        "llama_cpp_decode_tok_s": lb_tg, "llama_cpp_prefill_tok_s": lb_pp,
    }
    summary.append(s)
    f = lambda v, d=1: "-" if v is None or v != v else f"{v:.{d}f}"
    rows.append(f"| {name} | {f(s['weight_mb'], 0)} | {f(s['prefill_tok_s'])} | {f(tps)} ({f(s['tpot_ms'], 2)} ms) | {f(s['host_busy_ms_per_token'], 3)} | {f(gbps)} ({f(100 * s['fraction_of_copy'] if s['fraction_of_copy'] else None, 0)}% of copy) | {f(s['step_at_a_time_tok_s'])} | {f(lb_pp)} / {f(lb_tg)} |")
json.dump(summary, open(f"{out}/gpu-bench.json", "w"), indent=2)
adapters = ", ".join(f"{d['name']} ({d['backend']}, copy {d.get('copy_gbps', 0):.0f} GB/s)" for d in devices)
md = "\n".join([
    f"Adapters: {adapters}", "",
    "| model | weights MB | prefill tok/s | decode tok/s (TPOT) | host busy ms/token | weights read GB/s | one step at a time tok/s | llama.cpp Vulkan pp / tg tok/s |",
    "|---|---|---|---|---|---|---|---|", *rows])
open(f"{out}/gpu-bench.md", "w").write(md + "\n")
print(md)
EOF
}

mode="${1:-}"
case "$mode" in
    pack)
        dir="${2:?usage: scripts/gpu-bench.sh pack DIR}"
        build
        mkdir -p "$dir"
        cp "$root/target/release/lantern" "$dir/lantern"
        for m in "${models[@]}"; do
            "$dir/lantern" synth --like "$m" --header-only --out "$dir/$m.ggufh"
        done
        du -sh "$dir" >&2
        ;;
    run)
        dir="${2:?usage: scripts/gpu-bench.sh run DIR [OUT]}"
        out="${3:-${OUT:-$dir/out}}"
        work="$(mktemp -d)"
        trap 'rm -rf "$work"' EXIT
        files=()
        for m in "${models[@]}"; do
            "$dir/lantern" synth --like "$dir/$m.ggufh" --out "$work/$m.gguf"
            files+=("$work/$m.gguf")
        done
        bench "$dir/lantern" "$out" "${files[@]}"
        ;;
    -h|--help)
        sed -n '2,22p' "$0"
        ;;
    *)
        out="${mode:-$root/target/gpu-bench}"
        build
        files=()
        for m in "${models[@]}"; do
            files+=("$("$root/target/release/lantern" fetch "$m")")
        done
        bench "$root/target/release/lantern" "$out" "${files[@]}"
        ;;
esac
