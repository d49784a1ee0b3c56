#!/usr/bin/env bash
# `harness_env.sh [VENV]`: the load harnesses kvtier is judged by that are not in vLLM's
# wheel (GuideLLM from PyPI), in an environment of their own so their pins never move
# kvtier's or vLLM's. GuideLLM requires torch: the CPU build is installed first, never a
# CUDA one. Idempotent: a stamp file skips the work when the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-.venv-harness}
GUIDELLM_VERSION=${KVTIER_GUIDELLM_VERSION:-0.8.1}
TORCH_VERSION=${KVTIER_TORCH_VERSION:-2.13.0}
STAMP="$VENV/.installed-guidellm-$GUIDELLM_VERSION"
[[ -f "$STAMP" ]] && exit 0
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"  # first: the CPU build
"$VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
"$VENV/bin/guidellm" --version
touch "$STAMP"
