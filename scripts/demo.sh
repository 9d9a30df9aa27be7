#!/usr/bin/env bash
# Set up (if needed), then train the example model twice with ftrun on this machine as two
# nodes of two ranks each: once clean, once with rank 1 killed at step 5. Both runs must end
# with the same params_xxh3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
