#!/usr/bin/env bash
# Set up (if needed) and run ftrun's checks: ruff, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check ftrun tests examples bench
# The suite runs on two pytest-xdist workers (FTRUN_TEST_WORKERS, default 2; 0: one
# process), one test file each at a time, the longest files first (tests/conftest.py): ~37 min
# with two on the 2-CPU CI machine. Timing-sensitive tests (marked serial: detection latency,
# a healthy run without findings) always run afterwards, alone (~8 min).
WORKERS=${FTRUN_TEST_WORKERS:-2}
PARALLEL=()
if [ "$WORKERS" != 0 ]; then
    PARALLEL=(-n "$WORKERS" --dist loadfile)
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" \
    -m "not serial" "$@" || [ $? -eq 5 ]
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m serial "$@" || [ $? -eq 5 ]
# (5: a part had no test to run, as when the arguments name one file.)
