#!/usr/bin/env bash
# Debian's chromium for the web app's browser test (Playwright drives it through its
# executable path; nothing is downloaded by Playwright). Needs root and apt-get; anywhere
# else it says why and exits 0, and the browser test skips with that reason.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: not root or no apt-get: the browser test will skip (apt-get install chromium)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; }; then
    echo "install-chromium: apt-get could not install chromium: the browser test will skip" >&2
fi
exit 0
