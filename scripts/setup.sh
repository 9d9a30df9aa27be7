#!/usr/bin/env bash
# Create .venv and install ftrun with its test tools. Idempotent; safe to re-run.
# The CPU build of torch is pinned first: a plain `torch` requirement would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
