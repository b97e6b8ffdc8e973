#!/usr/bin/env bash
# System packages that tests start for real: Debian's chromium (the web app's browser
# test; Playwright drives it through its executable path and downloads nothing),
# redis-server (the remote KV tier's tests start it on a loopback port), and on x86 an
# aarch64 cross compiler with qemu-user (the NEON decode kernels are built and run under
# qemu-aarch64 beside the x86 ones). Needs root and apt-get; anywhere else it says why and
# exits 0, and those tests skip with that reason.
set -u
missing=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ "$(uname -m)" = x86_64 ]; then
    command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
    command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: not root or no apt-get; the tests that need ${missing[*]} will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
for pkg in "${missing[@]}"; do
    apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null; } \
        || echo "install-system-deps: apt-get could not install $pkg; the tests that need it will skip" >&2
done
exit 0
