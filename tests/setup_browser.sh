#!/usr/bin/env bash
# Installs Debian's Chromium for the report's browser test (tests/test_report.py).
# Idempotent and fast when Chromium is already on PATH. Never fails the test run: if the
# install fails, the browser test skips and says why (it reads the log written here).
set -u
log="${TMPDIR:-/tmp}/autotune-setup-browser.log"
for candidate in chromium chromium-browser google-chrome; do
    if command -v "$candidate" >/dev/null 2>&1; then
        echo "browser: $(command -v "$candidate")"
        exit 0
    fi
done
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
    echo "browser: not installed (not root and no sudo); the report's browser test will skip" | tee "$log"
    exit 0
fi
as_root=""
[ "$(id -u)" != "0" ] && as_root="sudo -n"
echo "browser: installing Debian's chromium (log: $log)"
if $as_root apt-get update -qq >"$log" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq --no-install-recommends chromium >>"$log" 2>&1; then
    echo "browser: $(command -v chromium)"
else
    echo "browser: install failed (see $log); the report's browser test will skip"
fi
exit 0
