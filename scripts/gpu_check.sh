#!/usr/bin/env bash
# One command for the GPU machine: every GPU-marked test, the tier's CUDA copy paths over both
# KV layouts (restore GB/s beside the pinned H2D peak) and the wake benchmark on the tiny
# random model, in under 8 minutes, with only what a stock CUDA PyTorch image has. Results go
# to one JSON file ($OUT/gpu-check.json when $OUT is set, else ./gpu-check.json).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False, or no torch); skipped"
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'

status=0
tests_rc="not run"
if "$PY" -c 'import pytest, hypothesis' 2>/dev/null; then
    timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests | tail -n 15
    tests_rc=${PIPESTATUS[0]}
    [[ $tests_rc == 0 ]] || status=1
else
    echo "gpu_check: pytest or hypothesis is not installed; the GPU-marked tests were not run"
fi

timeout 180 "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu-check-copies.json" || status=1

wake_dir=$(mktemp -d)
timeout 240 "$PY" benchmarks/wake.py --model tiny --lengths 512,2048 --repeats 2 --out "$wake_dir" \
    | tail -n 8 || status=1

"$PY" - "$OUT_DIR/gpu-check.json" "$OUT_DIR/gpu-check-copies.json" "$wake_dir" "$tests_rc" "$status" <<'PY'
import json, pathlib, sys
out, copies, wake_dir, tests_rc, status = sys.argv[1:]
doc = {"tests_rc": tests_rc, "status": int(status)}
p = pathlib.Path(copies)
doc["copies"] = json.loads(p.read_text()) if p.exists() else None
wakes = sorted(pathlib.Path(wake_dir).glob("wake-*.json"))
doc["wake"] = json.loads(wakes[-1].read_text()) if wakes else None
pathlib.Path(out).write_text(json.dumps(doc, indent=2))
print("gpu_check: wrote", out, "PASS" if int(status) == 0 else "FAIL")
PY
exit $status
