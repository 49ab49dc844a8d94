#!/usr/bin/env bash
# Install what Lantern needs on a fresh Debian/Ubuntu machine, idempotently:
# the Rust toolchain (if missing) and Mesa's software Vulkan driver (lavapipe) plus the
# Vulkan loader, so that machines without a GPU still have an adapter.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: installing the Rust toolchain (rustup)" >&2
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
fi

if command -v dpkg >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    missing=()
    # LANTERN_SETUP_EXTRA: more packages a caller needs (scripts/test.sh: Xvfb and the X
    # libraries winit loads, for the windowed example's test).
    # shellcheck disable=SC2086
    for pkg in mesa-vulkan-drivers libvulkan1 ${LANTERN_SETUP_EXTRA:-}; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "setup: installing ${missing[*]}" >&2
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi
