#!/usr/bin/env bash
# Services the tests start themselves but whose binaries CI must have: PostgreSQL's server (initdb, pg_ctl)
# for tests/test_postgres_study.py. The test runs its own private instance on a loopback port.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
fi
