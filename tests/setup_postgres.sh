#!/usr/bin/env bash
# Installs Debian's PostgreSQL server for the sweep tests against a real database
# (tests/test_sweep_postgres.py starts its own server in a temporary folder). Idempotent and fast
# when the server binaries are there. Never fails the test run: if the install fails, those tests
# skip and say why (they read the log written here).
set -u
log="${TMPDIR:-/tmp}/autotune-setup-postgres.log"
source "$(dirname "$0")/apt_install.sh"
found() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }
if found || { apt_install postgres "$log" postgresql && found; }; then
    echo "postgres: $(ls /usr/lib/postgresql/*/bin/initdb | tail -1)"
else
    echo "postgres: install failed (see $log); the PostgreSQL sweep tests will skip"
fi
exit 0
