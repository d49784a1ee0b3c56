"""Per-request benchmark records -> summaries, a side-by-side table and JSON.

`summarize_config(records, engine, load, refused)` computes every latency figure from the
raw records, TTFT always split by residency class (a host tier makes it bimodal) and, within
each class, into queue / tier / compute as the engine measured them; it raises flags when
the run cannot show what offload costs: no idle gaps, a bimodal TTFT (naming the part that
makes the difference), a saturated machine, refused requests. `render_table`/`print_table`
put configurations side by side; `write_json` writes atomically (`html_report` the HTML).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtier.bench.load import saturation_message
from kvtier.bench.split import explain_gap, split_summary
from kvtier.engine.stats import summarize
from kvtier.sequence import RESIDENCY_CLASSES, SPLIT_PARTS
from kvtier.tier import Residency

COLD_CLASSES = (Residency.HOST, Residency.RECOMPUTED)
BIMODAL_RATIO = 3.0  # p50s this far apart are two populations, not one
BIMODAL_MIN_REQUESTS = 3
CLASS_COLORS = MappingProxyType({Residency.RESIDENT: "tab:green", Residency.HOST: "tab:orange",
                                 Residency.RECOMPUTED: "tab:red", Residency.NEW: "tab:blue"})
CONFIG_STYLES = ("-", "--", ":", "-.")
CONFIG_MARKERS = ("o", "^", "s", "D", "v", "x")
TABLE_CAPTION = ("TTFT cells: p50 / p90 / p99 ms (n requests); split cells: queue / tier / "
                 "compute ms, p50 then p90")
REFUSED_LISTED = 10
OPTIONAL_CLASSES = (Residency.DISK, Residency.SHARED)


def classes_of(records: Sequence[dict[str, Any]]) -> list[str]:
    """The known residency classes, then any other value the records carry (labels)."""
    known = [c.value for c in RESIDENCY_CLASSES]
    extra = sorted({r["residency"] for r in records} - set(known))
    return [*known, *extra]


def summarize_config(records: Sequence[dict[str, Any]], engine: dict[str, Any],
                     load: dict[str, Any] | None = None,
                     refused: Sequence[dict[str, Any]] = (),
                     scale_length: float | None = None) -> dict[str, Any]:
    """One configuration's report: latencies from `records`, tier counters from `engine`,
    `load` from `load.saturation`, `refused` the requests the server turned away."""
    n = len(records)
    classes = classes_of(records)
    ttft = {"all": summarize([r["ttft_s"] for r in records if r["ttft_s"] is not None])}
    for cls in classes:
        ttft[cls] = summarize([r["ttft_s"] for r in records
                               if r["residency"] == cls and r["ttft_s"] is not None])
    itl = summarize([r["itl_s"] for r in records if r["itl_s"] is not None])
    restore_bytes = sum(r["restore_bytes"] for r in records)
    restore_s = sum(r["restore_s"] for r in records)
    duration = (max(r["finish_s"] for r in records) - min(r["arrival_s"] for r in records)
                if records else 0.0)
    output_tokens = sum(r["output_tokens"] for r in records)
    summary: dict[str, Any] = {
        "config": records[0]["config"] if records else None,
        "requests": n,
        "sessions": len({r["session_id"] for r in records}),
        "ttft_s": ttft,
        "itl_s": {"count": itl["count"], "p50": itl["p50"], "p99": itl["p99"]},
        "residency_counts": {cls: sum(r["residency"] == cls for r in records)
                             for cls in classes},
        "context_tokens": sum(r["context_tokens"] for r in records),
        "output_tokens": output_tokens,
        "restored_tokens": sum(r["restored_tokens"] for r in records),
        "recomputed_tokens": sum(r["recomputed_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "restore_bytes": restore_bytes,
        "restore_bytes_per_request": restore_bytes / n if n else 0.0,
        "restore_s_total": restore_s,
        "restore_gbps": restore_bytes / restore_s / 1e9 if restore_s > 0 else None,
        "duration_s": duration,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        **_engine_part(engine),
        "split_s": split_summary(records, classes),
        "saturation": load,
        "refused": refused_summary(refused, engine.get("max_model_len"), scale_length),
    }
    summary["flags"] = _flags(records, ttft, summary)
    return summary


def refused_summary(refused: Sequence[dict[str, Any]], max_model_len: int | None,
                    scale_length: float | None) -> dict[str, Any]:
    """How many requests were turned away, the first few, and how to make the trace fit."""
    hint = None
    longest = max((r["prompt_tokens"] or 0 for r in refused), default=0)
    if max_model_len and longest >= max_model_len:
        hint = (f"the longest refused prompt has {longest} tokens and max_model_len is "
                f"{max_model_len}: raise --max-model-len (and --num-device-blocks, which caps "
                "it)")
        if scale_length is not None:
            fit = scale_length * 0.9 * max_model_len / longest
            hint += f", or shrink the trace with --scale-length {fit:.3g}"
    return {"count": len(refused), "requests": list(refused[:REFUSED_LISTED]), "hint": hint}


def _engine_part(engine: dict[str, Any]) -> dict[str, Any]:
    """What only the engine knows: link busy time, preemptions, host pool, planner error."""
    pre = engine.get("preemptions") or {}
    part: dict[str, Any] = {
        "preemptions": {"total": pre.get("total", 0), "swap": pre.get("swap", 0),
                        "recompute": pre.get("recompute", 0)},
        "link_utilisation": None, "link_gbps": None, "host_peak_slots": None,
        "host_capacity_slots": None, "planner_error": None,
    }
    tier = engine.get("host_tier")
    if tier is None:
        return part
    link = tier.get("link", {})
    part["link_utilisation"] = {d: link[d]["utilisation"] for d in ("store", "load") if d in link}
    part["link_gbps"] = {d: link[d]["gbps"] for d in ("store", "load") if d in link}
    slots = tier.get("slots", {})
    part["host_peak_slots"] = max(engine.get("host_peak_slots") or 0, slots.get("used", 0))
    part["host_capacity_slots"] = slots.get("capacity")
    part["planner_error"] = tier.get("planner", {}).get("error")
    return part


def _flags(records: Sequence[dict[str, Any]], ttft: dict[str, dict[str, Any]],
           summary: dict[str, Any]) -> list[dict[str, str]]:
    """Warnings that change how the numbers must be read."""
    flags = []
    cold = any(r["residency"] in COLD_CLASSES or r["restored_tokens"] or r["recomputed_tokens"]
               for r in records)
    if records and not cold:
        flags.append({"name": "no_idle_gaps",
                      "message": "no idle gaps: nothing went cold, offload looks free"})
    populated = [(cls, s["p50"]) for cls, s in ttft.items()
                 if cls != "all" and s["count"] >= BIMODAL_MIN_REQUESTS]
    pairs = [(slow, fast) for slow in populated for fast in populated
             if slow[1] > 0 and slow[1] >= BIMODAL_RATIO * fast[1]]
    if pairs:
        (slow, p_slow), (fast, p_fast) = max(
            pairs, key=lambda p: p[0][1] / p[1][1] if p[1][1] > 0 else float("inf"))
        load = summary["saturation"] or {}
        why = explain_gap(summary["split_s"], slow, fast, bool(load.get("saturated")))
        flags.append({"name": "bimodal",
                      "message": f"TTFT is bimodal: {slow} p50 {p_slow * 1e3:.1f} ms vs "
                                 f"{fast} p50 {p_fast * 1e3:.1f} ms; "
                                 + (f"{why}" if why else "the overall p50 averages two "
                                    "populations")})
    load = summary["saturation"]
    if load and load["saturated"]:
        flags.append({"name": "saturated", "message": saturation_message(load)})
    refused = summary["refused"]
    if refused["count"]:
        first = refused["requests"][0]
        text = (f"{refused['count']} requests refused, their sessions ended there; first: "
                f"{first['request']}: {first['reason']}")
        flags.append({"name": "refused",
                      "message": text + (f"; {refused['hint']}" if refused["hint"] else "")})
    return flags


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ttft_cell(s: dict[str, Any]) -> str:
    if not s or not s["count"]:
        return "- (n=0)"
    return f"{_ms(s['p50'])} / {_ms(s['p90'])} / {_ms(s['p99'])} (n={s['count']})"


def _split_cell(entry: dict[str, Any] | None) -> str:
    if not entry or not entry["count"]:
        return "-"
    return " · ".join(" / ".join(_ms(entry[p][q]) for p in SPLIT_PARTS) for q in ("p50", "p90"))


def _load_cell(load: dict[str, Any] | None) -> str:
    if not load:
        return "-"
    return f"{_pct(load['utilisation'])} / {_pct(load['queue_share'])}"


def _tps_cell(load: dict[str, Any] | None) -> str:
    if not load:
        return "-"
    return " / ".join("-" if v is None else f"{v:.0f}"
                      for v in (load["offered_tokens_per_s"], load["achieved_tokens_per_s"]))


def _planner_cell(error: dict[str, Any] | None) -> str:
    if not error:
        return "-"
    return ", ".join(f"{kind} {e['median_rel_error']:.0%} (n={e['count']})"
                     for kind, e in error.items())


def table_rows(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(row label, one cell per configuration): the table both text and HTML show."""
    cfgs = list(summaries.values())
    classes = list(dict.fromkeys(c for s in cfgs for c in s["ttft_s"] if c != "all"))
    # Tiers below host get a row only where some configuration had one (they are opt-in).
    classes = [c for c in classes if c not in OPTIONAL_CLASSES
               or any(s["ttft_s"].get(c, {}).get("count") for s in cfgs)]

    def row(label: str, cell: Any) -> tuple[str, list[str]]:
        return label, [cell(s) for s in cfgs]

    def pair(key: str, a: str, b: str, fmt: Any) -> Any:
        return lambda s: "-" if s[key] is None else f"{fmt(s[key].get(a))} / {fmt(s[key].get(b))}"

    return [
        row("TTFT all", lambda s: _ttft_cell(s["ttft_s"]["all"])),
        *(row(f"TTFT {c}", lambda s, c=c: _ttft_cell(s["ttft_s"].get(c, {})))
          for c in classes),
        *(row(f"split {c}", lambda s, c=c: _split_cell(s.get("split_s", {}).get(c)))
          for c in ["all", *classes]),
        row("busy / queue share of TTFT", lambda s: _load_cell(s.get("saturation"))),
        row("offered / achieved tok/s", lambda s: _tps_cell(s.get("saturation"))),
        row("refused requests", lambda s: str(s.get("refused", {}).get("count", 0))),
        row("ITL p50 / p99 ms", lambda s: f"{_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p99'])}"),
        row("sessions / requests", lambda s: f"{s['sessions']} / {s['requests']}"),
        row("output tok/s", lambda s: "-" if s["output_tokens_per_s"] is None
            else f"{s['output_tokens_per_s']:.1f}"),
        row("restore MB/request", lambda s: f"{s['restore_bytes_per_request'] / 1e6:.2f}"),
        row("restore GB/s achieved", lambda s: "-" if s["restore_gbps"] is None
            else f"{s['restore_gbps']:.2f}"),
        row("link util store / load", pair("link_utilisation", "store", "load", _pct)),
        row("swaps / recomputes", lambda s: f"{s['preemptions']['swap']} / "
                                            f"{s['preemptions']['recompute']}"),
        row("host slots peak / cap", lambda s: "-" if s["host_peak_slots"] is None
            else f"{s['host_peak_slots']} / {s['host_capacity_slots']}"),
        row("planner median error", lambda s: _planner_cell(s["planner_error"])),
        row("flags", lambda s: ", ".join(f["name"] for f in s["flags"]) or "none"),
    ]


def render_table(summaries: dict[str, dict[str, Any]]) -> Any:
    """A rich Table with one column per configuration."""
    from rich.table import Table

    table = Table(title="kvtier bench: TTFT split by where the state lived",
                  caption=TABLE_CAPTION)
    table.add_column("metric", style="bold")
    for name in summaries:
        table.add_column(name, justify="right")
    for label, cells in table_rows(summaries):
        table.add_row(label, *cells)
    return table


def print_table(summaries: dict[str, dict[str, Any]], console: Any = None) -> None:
    """Print the table, then each configuration's flags in words."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    console.print(render_table(summaries))
    for name, s in summaries.items():
        for flag in s["flags"]:
            console.print(f"[yellow]{escape(name)}: {escape(flag['message'])}[/yellow]")


def atomic_write(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def write_json(path: str | Path, payload: Any) -> None:
    """Atomic JSON file (indent 2); paths, dataclasses and numpy scalars become JSON values."""
    atomic_write(path, json.dumps(payload, indent=2, default=jsonable) + "\n")
