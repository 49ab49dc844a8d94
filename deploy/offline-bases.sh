#!/usr/bin/env bash
# Builds local stand-ins for the three base images the Dockerfiles name (debian:bookworm-slim,
# rust:1-bookworm, python:3.12-slim) from a Debian mirror and this host's Rust toolchain, for
# machines that reach a Debian mirror but not Docker Hub (air-gapped build hosts, sandboxes).
# With Docker Hub reachable you never need this: `docker build` pulls the real images.
#
#   sudo deploy/offline-bases.sh            # then: docker build -t lantern . (as usual)
#
# What the stand-ins are, honestly:
# - debian:bookworm-slim: `debootstrap --variant=minbase bookworm`, the same Debian release.
# - rust:1-bookworm: that, plus gcc/libc6-dev/pkg-config/ca-certificates and the host's own
#   stable toolchain (rustc and cargo as `rustup` installed them) under /usr/local/rust.
# - python:3.12-slim: that, plus Debian's python3 (3.11 on bookworm) and pip. smg's wheel
#   supports both; the image tag stays the one the Dockerfile names so it needs no change.
# Behind a TLS-intercepting proxy, LANTERN_EXTRA_CA=/path/to/ca.pem puts that CA in every
# stand-in's /usr/local/share/ca-certificates, so cargo, pip, and the runtime image (whose
# `apt-get install ca-certificates` picks it up) trust it.
# Needs root (debootstrap), docker and debootstrap. Idempotent: an existing tag is kept unless
# LANTERN_REBUILD_BASES=1.
set -euo pipefail
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="${TMPDIR:-/tmp}/lantern-bases"
have() { [ "${LANTERN_REBUILD_BASES:-0}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }
step() { echo "offline-bases: $*" >&2; }

command -v debootstrap >/dev/null || { echo "offline-bases: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
mkdir -p "$work"

if [ ! -x "$work/base/bin/sh" ]; then
    step "debootstrap bookworm from $mirror (a minute or two)"
    rm -rf "$work/base"
    debootstrap --variant=minbase bookworm "$work/base" "$mirror" >"$work/debootstrap.log"
    rm -f "$work/base/etc/apt/sources.list"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$mirror" >"$work/base/etc/apt/sources.list.d/debian.sources"
    chroot "$work/base" apt-get clean
    rm -rf "$work/base/var/lib/apt/lists/"*
fi
if [ -n "${LANTERN_EXTRA_CA:-}" ]; then
    mkdir -p "$work/base/usr/local/share/ca-certificates"
    cp "$LANTERN_EXTRA_CA" "$work/base/usr/local/share/ca-certificates/lantern-extra-ca.crt"
fi

# A rootfs: the base, plus Debian packages, plus what the caller copies in; imported as a tag.
derive() {
    local tag="$1" dir="$work/$2"; shift 2
    local packages="$1"; shift
    rm -rf "$dir" && cp -a "$work/base" "$dir"
    if [ -n "$packages" ]; then
        mount --bind /proc "$dir/proc"
        cp /etc/resolv.conf "$dir/etc/resolv.conf"
        chroot "$dir" sh -c "apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $packages >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/*" \
            || { umount "$dir/proc"; return 1; }
        umount "$dir/proc"
    fi
    echo "$dir"
}

if ! have debian:bookworm-slim; then
    step "importing debian:bookworm-slim"
    tar -C "$work/base" -c . | docker import - debian:bookworm-slim >/dev/null
fi

if ! have rust:1-bookworm; then
    toolchain="$(rustc --print sysroot)"
    step "rust:1-bookworm with $(rustc --version) from $toolchain"
    dir="$(derive rust:1-bookworm rust "gcc libc6-dev make pkg-config ca-certificates git")"
    mkdir -p "$dir/usr/local/rust"
    cp -a "$toolchain/bin" "$toolchain/lib" "$dir/usr/local/rust/"
    tar -C "$dir" -c . | docker import \
        --change 'ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV CARGO_HOME=/usr/local/cargo' - rust:1-bookworm >/dev/null
    rm -rf "$dir"
fi

if ! have python:3.12-slim; then
    step "python:3.12-slim (Debian's python3 and pip)"
    dir="$(derive python:3.12-slim python "python3 python3-pip ca-certificates")"
    tar -C "$dir" -c . | docker import \
        --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - python:3.12-slim >/dev/null
    rm -rf "$dir"
fi
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(debian:bookworm-slim|rust:1-bookworm|python:3.12-slim) ' >&2
