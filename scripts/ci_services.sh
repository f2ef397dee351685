#!/usr/bin/env bash
# Services the tests start themselves but whose binaries CI must have: PostgreSQL's server (initdb, pg_ctl)
# for tests/test_postgres_study.py. The test runs its own private instance on a loopback port, and fails
# (never installs anything) when the binaries are missing.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq postgresql >/dev/null
fi
ls /usr/lib/postgresql/*/bin/pg_ctl /usr/lib/postgresql/*/bin/initdb >/dev/null  # fail here, not in the test
