#!/usr/bin/env bash
# Installs Debian's Chromium for the report's browser test (tests/test_report.py).
# Idempotent and fast when Chromium is already on PATH. Never fails the test run: if the
# install fails, the browser test skips and says why (it reads the log written here).
set -u
log="${TMPDIR:-/tmp}/autotune-setup-browser.log"
source "$(dirname "$0")/apt_install.sh"
for candidate in chromium chromium-browser google-chrome; do
    if command -v "$candidate" >/dev/null 2>&1; then
        echo "browser: $(command -v "$candidate")"
        exit 0
    fi
done
if apt_install browser "$log" chromium && command -v chromium >/dev/null 2>&1; then
    echo "browser: $(command -v chromium)"
else
    echo "browser: install failed (see $log); the report's browser test will skip"
fi
exit 0
