#!/usr/bin/env bash
# Installs everything the tests need, then checks the code (lint, types) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m mypy
exec "$PY" -m pytest -q "$@"
