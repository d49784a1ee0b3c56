#!/usr/bin/env bash
# `lmcache_env.sh [VENV]`: LMCache 0.5.6, the peer kvtier is measured beside, as vLLM CPU's
# host tier: its multi-process server and `LMCacheMPConnector` (the in-process connector
# silently does nothing on CPU: ../shared/notes/lmcache-on-vllm-cpu.md). An environment of
# its own that sees the vLLM environment's packages (a .pth file), so vLLM, torch 2.13 CPU
# and numpy are that venv's: LMCache's own pins would pull CUDA packages and move vLLM's, so
# it is installed without them, with the few modules its CPU path imports. Idempotent: a
# stamp file skips the work when the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${KVTIER_VLLM_VENV:-.venv-vllm}
VENV=${1:-.venv-lmcache}
LMCACHE_VERSION=${KVTIER_LMCACHE_VERSION:-0.5.6}
STAMP="$VENV/.installed-lmcache-$LMCACHE_VERSION"
[[ -f "$STAMP" ]] && exit 0
bash scripts/vllm_env.sh "$VLLM_VENV"
"$VLLM_VENV/bin/python" -m venv "$VENV"
own=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
theirs=$("$VLLM_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(cd "$theirs" && pwd)" > "$own/zz-vllm-venv.pth"  # after the venv's own packages
# LMCache asks for setuptools >= 77: the vLLM venv's is seen once the venv's own is gone
rm -rf "$own"/setuptools "$own"/setuptools-*.dist-info "$own"/_distutils_hack "$own"/distutils-precedence.pth
"$VENV/bin/python" -m pip install -q --no-deps "lmcache==$LMCACHE_VERSION" \
    sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10 \
    opentelemetry-exporter-prometheus==0.66b2
"$VENV/bin/python" -c "import lmcache.v1.multiprocess.server, vllm; \
print('lmcache', '$LMCACHE_VERSION', 'beside vllm', vllm.__version__, 'ready')"
touch "$STAMP"
