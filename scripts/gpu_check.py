"""The tier's CUDA paths, checked on a real GPU with nothing but torch (and numpy, xxhash):
pinned host pool, side streams and events, whole and layerwise loads, over the KV layouts
(kvtier's contiguous one, one tensor per layer, and vLLM's CUDA tensors as the connector's
`ExpectedLayout` accepts them), byte for byte; restore GB/s beside
the measured pinned host -> device peak of the same machine. Writes one JSON file.

    python scripts/gpu_check.py --out gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.integrations.vllm.worker_side import ExpectedLayout
from kvtier.tier import Job, KVLayout, Medium, TierWorker
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.transfer import TransferEngine

# SmolLM2-135M's KV in bfloat16: 30 layers, 3 KV heads of 64, blocks of 16 tokens
LAYERS, HEADS, DIM, BS = 30, 3, 64, 16
SESSION_BLOCKS = 2048 // BS  # a 2048-token session


def pinned_peak_gbps(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Best-of-N GB/s of one pinned host <-> device copy."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = host.numel() / best / 1e9
    return out


def layouts(num_blocks: int) -> dict[str, KVLayout]:
    kv = torch.randn(num_blocks, LAYERS, BS, 2, HEADS, DIM, device="cuda",
                     dtype=torch.bfloat16)
    layers = {f"model.layers.{i}.self_attn.attn":
              torch.randn(num_blocks, HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16)
              for i in range(LAYERS)}
    # vLLM on CUDA: the LBHNC layout the connector requests, each layer allocated apart,
    # through the connector's own check of what register_kv_caches hands it
    expected = ExpectedLayout(LAYERS, num_blocks, (HEADS, BS, 2 * DIM), torch.bfloat16, 0)
    return {"contiguous": KVLayout.from_contiguous(kv), "per-layer": KVLayout.from_layers(layers),
            "vllm-cuda": expected.check({name: t.clone() for name, t in layers.items()})}


def block(layout: KVLayout, b: int) -> torch.Tensor:
    return torch.stack([layout.layer_view(layer)[b] for layer in range(layout.num_layers)])


def check_layout(name: str, layout: KVLayout, n: int) -> dict[str, Any]:
    host = HostPool.like(layout, n)
    assert host.pinned, "a CUDA layout gets a pinned host pool"
    w = TierWorker(host, TransferEngine(layout, host, blocks_per_chunk=16))
    src, dst = list(range(n)), list(range(n, 2 * n))
    before = torch.stack([block(layout, b) for b in src]).clone()
    out: dict[str, Any] = {"layout": name, "blocks": n, "block_bytes": layout.block_nbytes}
    try:
        w.submit(Job(0, Medium.DEVICE, Medium.HOST, tuple(range(n)), device_blocks=tuple(src)))
        store = w.wait(0)
        out["store_gbps"] = store.nbytes / store.seconds / 1e9
        for job_id, layerwise in ((1, False), (2, True)):
            for b in dst:
                layout.layer_view(0)[b].zero_()
            w.submit(Job(job_id, Medium.HOST, Medium.DEVICE, tuple(range(n)),
                         device_blocks=tuple(dst), layerwise=layerwise))
            if layerwise:
                assert all(w.wait_layer(job_id, layer) for layer in range(layout.num_layers))
            result = w.wait(job_id)
            torch.cuda.synchronize()
            after = torch.stack([block(layout, b) for b in dst])
            key = "layerwise" if layerwise else "whole"
            out[f"{key}_exact"] = bool(result.success and torch.equal(after, before))
            out[f"{key}_gbps"] = result.nbytes / result.seconds / 1e9
    finally:
        w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); skipped")
        return 0
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "peak": pinned_peak_gbps(), "layouts": []}
    for name, layout in layouts(2 * SESSION_BLOCKS).items():
        report["layouts"].append(check_layout(name, layout, SESSION_BLOCKS))
    h2d = report["peak"]["h2d"]
    print(f"{report['device']}: pinned H2D peak {h2d:.1f} GB/s, D2H {report['peak']['d2h']:.1f}")
    print(f"{'layout':>11} {'MB':>6} {'store':>7} {'whole':>7} {'x peak':>6} {'layerwise':>9}"
          f" {'x peak':>6}  exact")
    ok = True
    for r in report["layouts"]:
        exact = r["whole_exact"] and r["layerwise_exact"]
        ok = ok and exact
        print(f"{r['layout']:>11} {r['blocks'] * r['block_bytes'] / 1e6:6.1f} "
              f"{r['store_gbps']:7.1f} {r['whole_gbps']:7.1f} {r['whole_gbps'] / h2d:6.2f} "
              f"{r['layerwise_gbps']:9.1f} {r['layerwise_gbps'] / h2d:6.2f}  {exact}")
    report["ok"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
