"""Capacity: how many sessions wake without recompute when the device pool holds K of them
and the host pool ten times more; and what in-flight offloads cost running decodes.

    python benchmarks/capacity.py [--model PATH] [--sessions-on-device 4] [--session-tokens 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel, load_model
from kvtier.sequence import SamplingParams

FOLLOW_UP = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ask(engine: LLMEngine, prompt: list[int]) -> Any:
    rid = engine.add_request(prompt, ONE)
    return engine.run_to_completion([rid])[rid]


def wake_capacity(loaded: LoadedModel, k: int, session_tokens: int, bs: int) -> dict[str, Any]:
    """Fill device + host with as many sessions as they hold together, then wake every one."""
    footprint = -(-(session_tokens + FOLLOW_UP + 1) // bs)  # blocks a woken session holds
    device_blocks = k * footprint + 2
    block_bytes = loaded.spec.kv_bytes_per_token(4) * bs  # float32 KV on CPU
    host_slots = 10 * k * footprint
    capacity = (device_blocks + host_slots) // footprint
    engine = LLMEngine(EngineConfig.from_knobs(
        model=loaded.source, num_device_blocks=device_blocks,
        kv_offloading_size=host_slots * block_bytes / 2**30 + 1e-9,
        kv_write_policy="write_back", max_num_batched_tokens=session_tokens + FOLLOW_UP,
    ), loaded=loaded)
    assert engine.tier.enabled and engine.tier.report().host.capacity == host_slots
    rng = random.Random(0)
    vocab = loaded.spec.vocab_size
    sessions = [[rng.randrange(100, vocab) for _ in range(session_tokens)]
                for _ in range(capacity)]
    for s in sessions:
        ask(engine, s)
    woken = []
    for s in sessions:  # oldest first: the hardest order for an LRU
        out = ask(engine, s + [rng.randrange(100, vocab) for _ in range(FOLLOW_UP)])
        kept = out.num_cached_tokens + out.num_restored_tokens
        woken.append({"residency": out.residency, "kept_tokens": kept,
                      "recomputed": out.num_recomputed_tokens,
                      "ttft_s": out.metrics.ttft_s})
    full = session_tokens // bs * bs
    no_recompute = sum(1 for w in woken if w["kept_tokens"] >= full)
    engine.close()
    return {"device_blocks": device_blocks, "host_slots": host_slots,
            "blocks_per_session": footprint, "capacity_sessions": capacity,
            "woke_without_recompute": no_recompute, "ratio": no_recompute / capacity,
            "by_residency": {c: sum(1 for w in woken if w["residency"] == c)
                             for c in ("resident", "host", "recomputed", "new")}}


def decode_under_offload(loaded: LoadedModel, batch: int, steps: int,
                         store_gbps: float | None) -> dict[str, Any]:
    """Median decode step time of `batch` running sequences, without and with stores of
    other sessions' KV in flight on the transfer worker (capped at `store_gbps`)."""
    engine = LLMEngine(EngineConfig.from_knobs(
        model=loaded.source, num_device_blocks=1400, kv_offloading_size=1.2,
        kv_write_policy="write_back", max_num_batched_tokens=4096,
        max_store_gbps=store_gbps), loaded=loaded)
    assert engine.tier.enabled
    rng = random.Random(1)
    vocab = loaded.spec.vocab_size
    for _ in range(4):  # idle sessions whose ~1,000 cached blocks will be offloaded
        ask(engine, [rng.randrange(100, vocab) for _ in range(4000)])
    params = SamplingParams(max_tokens=4 * steps + 40, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(128)], params)
    for _ in range(6):
        engine.step()  # prefills done; pure decode from here

    def timed(n: int, require_busy: bool) -> list[float]:
        out = []
        while len(out) < n:
            if require_busy and not engine.tier.busy:
                break
            t = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t)
        return out

    quiet = timed(steps, require_busy=False)
    engine.tier.demote_all()
    engine.tier.submit()
    busy = timed(steps, require_busy=True)
    quiet_after = timed(steps, require_busy=False)
    stats = engine.tier.worker.report().link
    engine.close()
    base = statistics.median(quiet + quiet_after)
    loaded_step = statistics.median(busy) if busy else float("nan")
    return {"batch": batch, "max_store_gbps": store_gbps, "quiet_step_s": base,
            "busy_step_s": loaded_step,
            "busy_steps": len(busy), "ratio": loaded_step / base,
            "store_gbps": stats.store.gbps, "stored_bytes": stats.store.bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sessions-on-device", type=int, default=4)
    ap.add_argument("--session-tokens", type=int, default=256)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--max-store-gbps", type=float, default=0.5,
                    help="the store bandwidth cap measured beside the uncapped run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model)
    cap = wake_capacity(loaded, args.sessions_on_device, args.session_tokens, 16)
    decs = [decode_under_offload(loaded, args.decode_batch, 12, cap)
            for cap in (None, args.max_store_gbps)]
    print(f"model {loaded.source}")
    print(f"device {cap['device_blocks']} blocks + host {cap['host_slots']} slots = "
          f"{cap['capacity_sessions']} sessions of {cap['blocks_per_session']} blocks")
    print(f"woke without recompute: {cap['woke_without_recompute']} / "
          f"{cap['capacity_sessions']} = {cap['ratio']:.2f}  {cap['by_residency']}")
    for dec in decs:
        print(f"decode step, batch {dec['batch']}, max_store_gbps={dec['max_store_gbps']}: "
              f"quiet {dec['quiet_step_s'] * 1e3:.1f} ms, with offloads in flight "
              f"{dec['busy_step_s'] * 1e3:.1f} ms ({dec['busy_steps']} steps, "
              f"x{dec['ratio']:.2f}; stores at {dec['store_gbps']:.1f} GB/s while busy)")
    targets = {"wake_without_recompute_ge_0.95x_capacity": cap["ratio"] >= 0.95}
    for dec in decs:
        targets[f"decode_step_with_offloads_le_1.1x@max_store_gbps={dec['max_store_gbps']}"] = (
            dec["ratio"] <= 1.1)
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    path = write_result("capacity", {"model": loaded.source, "capacity": cap, "decode": decs,
                                     "targets": targets}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
