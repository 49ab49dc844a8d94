#!/usr/bin/env bash
# The browser build and demo, from a fresh machine (idempotent):
#   scripts/web.sh            build web/pkg (wasm + JS bindings, wasm-opt'd), report its size
#   scripts/web.sh serve      ...then pack the package, build the demo on it (web/site), fetch
#                             the default model and serve the demo on localhost
#   scripts/web.sh pack       ...and pack the npm package: web/dist/lantern-web-<version>.tgz
#   scripts/web.sh test-deps  ...pack, build the demo, install Chromium and the package's test app (tests/
#                             web-package: the tarball, esbuild, the openai client): what
#                             the browser tests need (test.sh)
#   scripts/web.sh e2e        ...then run the end-to-end test in Debian's Chromium
# Installs what it needs: the wasm32 target, wasm-bindgen-cli at exactly the version the
# crate pins, Node packages (binaryen's wasm-opt, playwright-core), and for e2e Debian's
# chromium.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# shellcheck source=setup.sh
source scripts/setup.sh

mode="${1:-build}"

# --- tools -----------------------------------------------------------------------------
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
want_wb="$(grep -A1 '^name = "wasm-bindgen"$' Cargo.lock | sed -n 's/^version = "\(.*\)"/\1/p' | head -1)"
have_wb="$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)"
if [ "$have_wb" != "$want_wb" ]; then
    echo "web.sh: installing wasm-bindgen-cli $want_wb (the crate's exact version)" >&2
    # Unoptimized: builds in a third of the time; it then takes ~3 s instead of ~1 s per run
    # and writes the same bytes.
    CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_LTO=false \
        CARGO_PROFILE_RELEASE_CODEGEN_UNITS=256 cargo install wasm-bindgen-cli --version "=$want_wb"
fi
if ! command -v node >/dev/null 2>&1; then
    echo "web.sh: installing Node.js" >&2
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi
if [ ! -x web/node_modules/.bin/wasm-opt ] || [ ! -d web/node_modules/playwright-core ] || [ ! -d web/node_modules/marked ] \
    || [ ! -d web/node_modules/dompurify ] || [ ! -x web/node_modules/.bin/esbuild ]; then
    (cd web && npm install --no-audit --no-fund --loglevel=error)
fi

# --- build -----------------------------------------------------------------------------
cargo rustc --lib --release --target wasm32-unknown-unknown --no-default-features --features web --crate-type cdylib
wasm-bindgen --target web --no-typescript --out-dir web/pkg target/wasm32-unknown-unknown/release/lantern.wasm
raw=$(stat -c %s web/pkg/lantern_bg.wasm)
web/node_modules/.bin/wasm-opt -Os --enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext \
    --enable-mutable-globals --enable-reference-types --enable-multivalue \
    web/pkg/lantern_bg.wasm -o web/pkg/lantern_bg.opt.wasm
mv web/pkg/lantern_bg.opt.wasm web/pkg/lantern_bg.wasm
opt=$(stat -c %s web/pkg/lantern_bg.wasm)
gz=$(gzip -9 -c web/pkg/lantern_bg.wasm | wc -c)
awk -v o="$opt" -v r="$raw" -v g="$gz" 'BEGIN { printf "web.sh: web/pkg/lantern_bg.wasm %.2f MB (%.2f MB before wasm-opt, %.2f MB gzipped)\n", o/1e6, r/1e6, g/1e6 }' >&2
printf '{"raw_bytes": %d, "opt_bytes": %d, "gzip_bytes": %d}\n' "$raw" "$opt" "$gz" > web/pkg/size.json

ensure_chromium() {
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        echo "web.sh: installing chromium and chromium-driver" >&2
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
    fi
}

# The npm package: web/package's module, worker and types with the wasm build, versioned
# as the crate.
pack() {
    local stage=target/npm/lantern-web version
    version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
    rm -rf "$stage" && mkdir -p "$stage" web/dist
    cp web/package/index.js web/package/index.d.ts web/package/worker.js web/package/README.md web/pkg/lantern.js web/pkg/lantern_bg.wasm "$stage"/
    node -e 'const f=process.argv[1], p=JSON.parse(require("fs").readFileSync(f)); p.version=process.argv[2]; require("fs").writeFileSync(process.argv[3], JSON.stringify(p, null, 2) + "\n")' \
        web/package/package.json "$version" "$stage/package.json"
    rm -f web/dist/lantern-web-*.tgz
    (cd "$stage" && npm pack --pack-destination "$root/web/dist" --loglevel=error >/dev/null)
    echo "web.sh: web/dist/lantern-web-$version.tgz ($(stat -c %s "web/dist/lantern-web-$version.tgz") bytes)" >&2
}

# The demo (web/main.js), built on the package as any app would be: the tarball installed
# into web/ (npm's copy, not a link), bundled into web/site/ by web/build.mjs.
demo() {
    pack
    (cd web && npm install --no-save --no-audit --no-fund --loglevel=error "$root"/web/dist/lantern-web-*.tgz)
    node web/build.mjs
}

case "$mode" in
    build) ;;
    pack) pack ;;
    test-deps)
        demo
        ensure_chromium
        # The test app installs the tarball as any app would (npm's copy, not a link).
        (cd tests/web-package && npm install --no-audit --no-fund --loglevel=error \
            && npm install --no-save --no-audit --no-fund --loglevel=error "$root"/web/dist/lantern-web-*.tgz)
        ;;
    serve)
        demo
        cargo build --release --bin lantern
        ./target/release/lantern fetch >/dev/null
        exec node web/serve.mjs "${@:2}"
        ;;
    e2e)
        ensure_chromium
        export WGPU_BACKEND="${WGPU_BACKEND:-vulkan}" NODEVICE_SELECT=1
        cargo build --release --bin lantern
        LANTERN_SMOLLM2_GGUF="${LANTERN_SMOLLM2_GGUF:-$(./target/release/lantern fetch 2>/dev/null)}" \
            exec cargo test --release --test web -- --nocapture
        ;;
    *) echo "usage: scripts/web.sh [build|pack|serve|test-deps|e2e]" >&2; exit 2 ;;
esac
