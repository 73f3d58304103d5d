#!/usr/bin/env bash
# Installs Debian's Slurm (controller, node daemon, client) and munge for the sweep's Slurm test
# (tests/test_sweep_slurm.py starts a one-node cluster of its own). Idempotent and fast when they
# are there. Never fails the test run: if the install fails, that test skips and says why.
set -u
log="${TMPDIR:-/tmp}/autotune-setup-slurm.log"
source "$(dirname "$0")/apt_install.sh"
found() { command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; }
if found || { apt_install slurm "$log" slurm-wlm munge && found; }; then
    echo "slurm: $(command -v slurmctld)"
else
    echo "slurm: install failed (see $log); the Slurm sweep test will skip"
fi
exit 0
