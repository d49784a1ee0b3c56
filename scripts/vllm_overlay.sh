#!/usr/bin/env bash
# `vllm_overlay.sh [DIR] [VERSION]`: vLLM VERSION's wheel (the build GPU users run), its files
# unpacked into DIR without its dependencies, laid over .venv-vllm's (PYTHONPATH=DIR) by
# scripts/vllm_conformance.py's test: what kvtier uses of vLLM is checked against that
# version's own classes. No forward pass: its compiled parts need CUDA. Idempotent (a stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.vllm-0.34.0}
VERSION=${2:-0.34.0}
STAMP="$DIR/.unpacked-vllm-$VERSION"
[[ -f "$STAMP" ]] && exit 0
PARTIAL="$DIR.partial"
rm -rf "$PARTIAL"
mkdir -p "$PARTIAL"
.venv-vllm/bin/pip download -q --no-deps "vllm==$VERSION" -d "$PARTIAL/wheel"
.venv-vllm/bin/python -m zipfile -e "$PARTIAL"/wheel/vllm-"$VERSION"-*.whl "$PARTIAL/site"
rm -rf "$DIR"
mv "$PARTIAL/site" "$DIR"
rm -rf "$PARTIAL"
touch "$STAMP"
