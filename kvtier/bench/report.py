"""Per-request benchmark records -> summaries, a side-by-side table, JSON and a one-file HTML.

`summarize_config(records, engine)` computes every latency figure from the raw records,
TTFT always split by residency class (a host tier makes it bimodal), and raises flags when
the run cannot show what offload costs. `render_table`/`print_table` put configurations
side by side; `write_json` and `write_html` write atomically, the HTML with its plots
embedded so it opens anywhere with no network.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import html
import io
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtier.sequence import RESIDENCY_CLASSES
from kvtier.stats import summarize

COLD_CLASSES = ("host", "recomputed")
BIMODAL_RATIO = 3.0  # p50s this far apart are two populations, not one
BIMODAL_MIN_REQUESTS = 3
CLASS_COLORS = MappingProxyType({"resident": "tab:green", "host": "tab:orange",
                                 "recomputed": "tab:red", "new": "tab:blue"})
CONFIG_STYLES = ("-", "--", ":", "-.")
CONFIG_MARKERS = ("o", "^", "s", "D", "v", "x")
TABLE_CAPTION = "TTFT cells: p50 / p90 / p99 ms (n requests)"
OPTIONAL_CLASSES = ("disk", "remote")


def _classes(records: Sequence[dict[str, Any]]) -> list[str]:
    """The known residency classes, then any other value the records carry."""
    extra = sorted({r["residency"] for r in records} - set(RESIDENCY_CLASSES))
    return [*RESIDENCY_CLASSES, *extra]


def summarize_config(records: Sequence[dict[str, Any]], engine: dict[str, Any]) -> dict[str, Any]:
    """One configuration's report: latencies from `records`, tier counters from `engine`."""
    n = len(records)
    ttft = {"all": summarize([r["ttft_s"] for r in records if r["ttft_s"] is not None])}
    for cls in _classes(records):
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
                             for cls in _classes(records)},
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
    }
    summary["flags"] = _flags(records, ttft)
    return summary


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


def _flags(records: Sequence[dict[str, Any]], ttft: dict[str, dict[str, Any]]
           ) -> list[dict[str, str]]:
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
        flags.append({"name": "bimodal",
                      "message": f"TTFT is bimodal: {slow} p50 {p_slow * 1e3:.1f} ms vs "
                                 f"{fast} p50 {p_fast * 1e3:.1f} ms; the overall p50 "
                                 "averages two populations"})
    return flags


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ttft_cell(s: dict[str, Any]) -> str:
    if not s or not s["count"]:
        return "- (n=0)"
    return f"{_ms(s['p50'])} / {_ms(s['p90'])} / {_ms(s['p99'])} (n={s['count']})"


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


def _atomic_write(path: str | Path, text: str) -> None:
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


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def write_json(path: str | Path, payload: Any) -> None:
    """Atomic JSON file (indent 2); paths, dataclasses and numpy scalars become JSON values."""
    _atomic_write(path, json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure() -> tuple[Any, Any]:
    """A figure on the Agg canvas (no pyplot, no global backend switch) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _plot_cdf(records: Sequence[dict[str, Any]], configs: list[str]) -> str:
    fig, ax = _figure()
    positive = True
    for i, cfg in enumerate(configs):
        for cls in _classes(records):
            xs = sorted(r["ttft_s"] * 1e3 for r in records if r["config"] == cfg
                        and r["residency"] == cls and r["ttft_s"] is not None)
            if not xs:
                continue
            positive = positive and xs[0] > 0
            ys = [0.0, *((k + 1) / len(xs) for k in range(len(xs)))]
            ax.step([xs[0], *xs], ys, where="post", color=CLASS_COLORS.get(cls, "tab:gray"),
                    linestyle=CONFIG_STYLES[i % len(CONFIG_STYLES)],
                    label=f"{cfg} / {cls} (n={len(xs)})")
    if positive and ax.lines:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests",
           title="TTFT CDF by residency class (colour) and configuration (line style)")
    if ax.lines:
        ax.legend(fontsize="small")
    return _png(fig)


def _plot_context(records: Sequence[dict[str, Any]], configs: list[str]) -> str:
    fig, ax = _figure()
    for i, cfg in enumerate(configs):
        for cls in _classes(records):
            pts = [(r["context_tokens"], r["ttft_s"] * 1e3) for r in records
                   if r["config"] == cfg and r["residency"] == cls and r["ttft_s"] is not None]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, alpha=0.7,
                           color=CLASS_COLORS.get(cls, "tab:gray"),
                           marker=CONFIG_MARKERS[i % len(CONFIG_MARKERS)],
                           label=f"{cfg} / {cls}")
    ax.set(xlabel="session context (prompt tokens)", ylabel="TTFT (ms)",
           title="TTFT against context length, coloured by residency")
    if ax.collections:
        ax.legend(fontsize="small")
    return _png(fig)


def _plot_link(timelines: dict[str, list[dict[str, float]]]) -> str:
    fig, ax = _figure()
    for i, (cfg, samples) in enumerate(timelines.items()):
        if not samples:
            continue
        t = [s["t"] for s in samples]
        ax.plot(t, [s["store_util"] for s in samples], color=f"C{i % 10}", linestyle="-",
                label=f"{cfg} store (device->host)")
        ax.plot(t, [s["load_util"] for s in samples], color=f"C{i % 10}", linestyle="--",
                label=f"{cfg} load (host->device)")
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no link samples (no host tier)", ha="center", transform=ax.transAxes)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="time since run start (s)", ylabel="busy fraction",
           title="Host link utilisation over time")
    return _png(fig)


def _html_table(summaries: dict[str, dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(n)}</th>" for n in summaries)
    body = "".join(f"<tr><th>{html.escape(label)}</th>"
                   + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
                   for label, cells in table_rows(summaries))
    return (f"<table><caption>{TABLE_CAPTION}</caption><tr><th>metric</th>{head}</tr>"
            f"{body}</table>")


def _html_meta(meta: dict[str, Any]) -> str:
    rows = []
    for key, value in meta.items():
        text = value if isinstance(value, str) else json.dumps(value, indent=1,
                                                              default=_jsonable)
        rows.append(f"<tr><th>{html.escape(str(key))}</th><td><pre>{html.escape(text)}"
                    "</pre></td></tr>")
    return f"<table>{''.join(rows)}</table>"


def write_html(path: str | Path, summaries: dict[str, dict[str, Any]],
               records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """One self-contained HTML report: plots as inline PNG, the table, flags and the meta.

    Link timelines come from `meta["link_timeline"]` ({config: samples}) or, failing that,
    from each summary's `link_timeline`.
    """
    configs = list(dict.fromkeys([*summaries, *(r["config"] for r in records)]))
    timelines = dict(meta.get("link_timeline") or {
        name: s["link_timeline"] for name, s in summaries.items() if s.get("link_timeline")})
    plots = [("TTFT CDF by residency", _plot_cdf(records, configs)),
             ("TTFT against context length", _plot_context(records, configs)),
             ("Host link utilisation", _plot_link(timelines))]
    figures = "".join(f'<h2>{html.escape(title)}</h2><img src="data:image/png;base64,{data}" '
                      f'alt="{html.escape(title)}">' for title, data in plots)
    flags = "".join(f"<li><b>{html.escape(name)}</b>: {html.escape(f['message'])}</li>"
                    for name, s in summaries.items() for f in s["flags"])
    shown_meta = {k: v for k, v in meta.items() if k != "link_timeline"}
    doc = (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvtier bench</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th{text-align:left}pre{margin:0;text-align:left}img{max-width:100%}</style>"
        "</head><body><h1>kvtier bench</h1>"
        f"<h2>Summary</h2>{_html_table(summaries)}"
        f"<h2>Flags</h2><ul>{flags or '<li>none</li>'}</ul>"
        f"{figures}<h2>Run</h2>{_html_meta(shown_meta)}</body></html>\n"
    )
    _atomic_write(path, doc)
