# syntax=docker/dockerfile:1
# `lantern` in a container: `docker build -t lantern .`, then
#   docker run --rm -p 8080:8080 -v lantern-models:/models lantern serve --host 0.0.0.0
# (any lantern command works: `docker run --rm lantern devices`). Models are fetched into
# /models (LANTERN_CACHE_DIR) on first use; mount a volume there to keep them.
#
# GPUs: the image carries the Vulkan loader and Mesa's drivers (radv for AMD, anv for Intel,
# lavapipe when there is no GPU). Intel/AMD: `--device /dev/dri`. NVIDIA: the NVIDIA Container
# Toolkit mounts the driver's Vulkan ICD when the `graphics` capability is asked for (set below),
# `--gpus all`. `lantern devices` in the container says which adapter it got.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin lantern

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libvulkan1 mesa-vulkan-drivers \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /models lantern \
    && mkdir /models && chown lantern /models
COPY --from=build /src/target/release/lantern /usr/local/bin/lantern
USER lantern
# Pin Vulkan: unpinned, wgpu falls back to a GL adapter with fewer features. Mesa's
# device-select layer is not needed with one adapter and breaks some headless setups.
ENV LANTERN_CACHE_DIR=/models \
    WGPU_BACKEND=vulkan \
    NODEVICE_SELECT=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,graphics,utility
VOLUME /models
EXPOSE 8080
# `lantern serve` drains on SIGTERM: it stops admitting (503 + Retry-After), finishes what runs
# within --shutdown-timeout seconds (30), then exits. Give it that long: `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["lantern"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
