#!/usr/bin/env bash
# Set up (if needed) and run ftrun's checks: ruff, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check ftrun tests examples bench
# Two workers, one test file each at a time (the heavy files first: tests/conftest.py). Most
# tests wait on real processes, timeouts and heartbeats: run one at a time, the suite kept
# one of the two CPUs idle half the time (33.6 CPU-minutes in 33.9 minutes).
# FTRUN_TEST_WORKERS=0 runs it in one process.
# Timing-sensitive tests (marked serial: slow-rank detection, healthy runs with no suspect)
# run afterwards, one at a time, with nothing beside them.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 \
    -n "${FTRUN_TEST_WORKERS:-2}" --dist loadfile -m "not serial" "$@" || [ $? -eq 5 ]
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m serial "$@" || [ $? -eq 5 ]
# (5: a part had no test to run, as when the arguments name one file.)
