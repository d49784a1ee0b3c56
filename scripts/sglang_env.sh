#!/usr/bin/env bash
# `sglang_env.sh [DIR]`: SGLang's HiCache storage classes for the tests of kvtier's SGLang
# backend. The sglang wheel has no CPU kernels to serve with, and its dependencies would pull
# a CUDA torch: it is installed without them, with exactly what its storage modules import
# (each without dependencies too), into DIR, a folder the tests put on PYTHONPATH over .venv
# (SGLang patches transformers when imported, so never into the test process itself).
# Idempotent: a stamp names the pinned set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=${1:-.sglang-libs}
PINS=(sglang==0.5.23 triton==3.9.0 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0
      pyzmq==27.3.0 dill==0.4.1 ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5
      aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
      yarl==1.25.1 propcache==0.5.4 attrs==26.1.0)
STAMP="$DEST/.installed-$(printf '%s\n' "${PINS[@]}" | md5sum | cut -c1-12)"
[[ -f "$STAMP" ]] && exit 0
rm -rf "$DEST.partial"
"$PY" -m pip install -q --no-deps --target "$DEST.partial" "${PINS[@]}"
PYTHONPATH="$DEST.partial" "$PY" -c \
  "import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.hicache_storage"
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
touch "$STAMP"
