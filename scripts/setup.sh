#!/usr/bin/env bash
# Create .venv and install ftrun with its test tools. Idempotent; safe to re-run.
# torch is pinned first, at the version ftrun is tested with, so that ftrun's own
# `torch>=2.11` requirement installs nothing more. On the project's machines pip resolves
# torch==2.13.0 to a local CPU build; elsewhere set PIP_INDEX_URL or PIP_EXTRA_INDEX_URL to
# a CPU wheel index if you do not want the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
