"""What the tier's books cost per eviction and per retention grant as the tier grows: the
scheduler's thread pays both, so neither may grow with the tier's slots.

    .venv/bin/python benchmarks/eviction_books.py [--slots 100000] [--stores 200] [--out DIR]

Eviction: a host tier of `--slots` slots, full, then `--stores` stores of one new 16-block
prefix each (16 evictions a store), timed one by one: with no retention, with one block
retained (by another tenant), with 40% of the slots retained, and with a default quota that
one noisy tenant is over, and with the tier full of 128-block prefixes stored a block at a
time with their parents (vLLM's way; eviction takes each prefix from its tail). The p50 and
p99 of a store, in ms.
Grant: a tenancy with a retention file in a temporary directory, `--grants` retentions of one
new 16-block prefix each granted on top of 40,000 retained blocks already saved: the p50 and
p99 of a grant, in ms, and the file's size at the end.
JSON goes to benchmarks/results/eviction_books-*.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

from kvtier.tier.books.host import HostTier
from kvtier.tier.books.retention_file import RetentionFile
from kvtier.tier.books.tenancy import Quotas, Tenancy
from kvtier.tier.keys import Medium

BLOCKS = 16  # a prefix: one store, one grant
TOKENS = (1,) * 16  # the token ids a key is stored with (never compared here)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(tier: HostTier, n: int, tenant: str = "") -> None:
    for lo in range(0, n, BLOCKS):
        keys = [key(i) for i in range(lo, min(lo + BLOCKS, n))]
        prepared = tier.prepare_store(keys, [TOKENS] * len(keys), tenant)
        assert prepared is not None
        tier.complete_store(prepared.keys, True)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def time_stores(tier: HostTier, slots: int, stores: int, tenant: str = "new") -> list[float]:
    """ms per store of one new prefix into the full tier (16 evictions each)."""
    out = []
    for s in range(stores):
        keys = [key(slots * 2 + s * BLOCKS + i) for i in range(BLOCKS)]
        parents = [None, *keys[:-1]]
        began = time.perf_counter()
        prepared = tier.prepare_store(keys, [TOKENS] * BLOCKS, tenant, parents=parents)
        out.append((time.perf_counter() - began) * 1e3)
        assert prepared is not None and len(prepared.evicted) == BLOCKS
        tier.complete_store(prepared.keys, True)
    return out


def eviction_case(name: str, slots: int, stores: int,
                  setup: Callable[[HostTier, Tenancy], None], quotas: Quotas | None = None
                  ) -> dict[str, Any]:
    tenancy = Tenancy(quotas, max_retention_s=86400.0)
    tier = HostTier(slots, tenancy=tenancy)
    setup(tier, tenancy)
    p50, p99 = percentiles(time_stores(tier, slots, stores))
    return {"case": name, "slots": slots, "store_p50_ms": p50, "store_p99_ms": p99}


def grant_case(retained: int, grants: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tenancy = Tenancy(max_retention_s=86400.0, file=RetentionFile(d))
        slots = retained + grants * BLOCKS
        tenancy.track(Medium.HOST, slots)
        tenancy.track(Medium.DISK, slots * 2)
        keys = [key(i) for i in range(slots)]
        tenancy.entered(Medium.DISK, keys, "t")
        tenancy.retain(keys[:retained], "t", 3600.0)
        out = []
        for g in range(grants):
            lo = retained + g * BLOCKS
            began = time.perf_counter()
            grant = tenancy.retain(keys[lo:lo + BLOCKS], "t", 3600.0)
            out.append((time.perf_counter() - began) * 1e3)
            assert grant.refused is None, grant
        size = sum(p.stat().st_size for p in Path(d).iterdir())
        reloaded = len(RetentionFile(d).load())
    p50, p99 = percentiles(out)
    assert reloaded == slots, (reloaded, slots)
    return {"case": f"grant over {retained} retained", "grant_p50_ms": p50,
            "grant_p99_ms": p99, "file_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=100_000)
    ap.add_argument("--stores", type=int, default=200)
    ap.add_argument("--grants", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    slots = args.slots

    def nothing(tier: HostTier, tenancy: Tenancy) -> None:
        fill(tier, slots)

    def one(tier: HostTier, tenancy: Tenancy) -> None:
        fill(tier, slots)
        tenancy.retain([key(slots - 1)], "", 3600.0)

    def share(tier: HostTier, tenancy: Tenancy) -> None:  # the oldest 40%: walked past
        fill(tier, slots)
        tenancy.retain([key(i) for i in range(int(0.4 * slots))], "", 3600.0)

    def noisy(tier: HostTier, tenancy: Tenancy) -> None:  # one tenant far over its quota
        fill(tier, slots // 2, "victim")
        fill_from = slots // 2
        for lo in range(fill_from, slots, BLOCKS):
            keys = [key(i) for i in range(lo, min(lo + BLOCKS, slots))]
            prepared = tier.prepare_store(keys, [TOKENS] * len(keys), "noisy")
            assert prepared is not None
            tier.complete_store(prepared.keys, True)

    def chains(tier: HostTier, tenancy: Tenancy) -> None:  # vLLM: a block as it fills
        for i in range(slots):
            parent = key(i - 1) if i % 128 else None
            prepared = tier.prepare_store([key(i)], [TOKENS], parents=[parent])
            assert prepared is not None
            tier.complete_store(prepared.keys, True)

    rows = [eviction_case("no retention", slots, args.stores, nothing),
            eviction_case("one retained block", slots, args.stores, one),
            eviction_case("40% retained (oldest)", slots, args.stores, share),
            eviction_case("quota, one tenant over", slots, args.stores, noisy,
                          Quotas(default={"host": slots // 4})),
            eviction_case("128-block chains, tail first", slots, args.stores, chains)]
    grants = [grant_case(40_000, args.grants)]
    print(f"{'eviction case':28} {'slots':>8} {'store p50 ms':>13} {'p99 ms':>9}")
    for r in rows:
        print(f"{r['case']:28} {r['slots']:>8} {r['store_p50_ms']:>13.3f} "
              f"{r['store_p99_ms']:>9.3f}")
    print(f"{'grant case':28} {'grant p50 ms':>13} {'p99 ms':>9} {'file bytes':>11}")
    for r in grants:
        print(f"{r['case']:28} {r['grant_p50_ms']:>13.3f} {r['grant_p99_ms']:>9.3f} "
              f"{r['file_bytes']:>11}")
    path = write_result("eviction_books", {"args": vars(args), "evictions": rows,
                                           "grants": grants}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
