#!/usr/bin/env bash
# Installs meshserve and what it needs, then serves the embedded default model on 127.0.0.1:8000.
# Extra arguments go to `meshserve serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m meshserve serve "$@"
