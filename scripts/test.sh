#!/usr/bin/env bash
# Set up (if needed) and run ftrun's checks: ruff, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check ftrun tests examples bench
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
