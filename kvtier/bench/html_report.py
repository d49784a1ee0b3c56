"""The one-file HTML report: the table, the flags, and plots embedded as PNG (no network).

Plots: TTFT CDF by residency class and configuration, TTFT against context length, the
queue / tier / compute split per class (stacked p50 and p90), and host link utilisation.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.report import (
    CLASS_COLORS,
    CONFIG_MARKERS,
    CONFIG_STYLES,
    REFUSED_LISTED,
    TABLE_CAPTION,
    atomic_write,
    classes_of,
    jsonable,
    table_rows,
)
from kvtier.sequence import SPLIT_PARTS

PART_COLORS = {"queue": "tab:gray", "tier": "tab:orange", "compute": "tab:blue"}


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
        for cls in classes_of(records):
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
        for cls in classes_of(records):
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


def _plot_split(summaries: dict[str, dict[str, Any]]) -> str:
    """Stacked bars, one per (configuration, class): queue, tier and compute p50 (solid) and
    p90 (hatched, beside it), in ms."""
    fig, ax = _figure()
    labels: list[str] = []
    for cfg, summary in summaries.items():
        for cls, entry in summary.get("split_s", {}).items():
            if cls == "all" or not entry["count"]:
                continue
            for q, hatch in (("p50", ""), ("p90", "//")):
                x, bottom = len(labels), 0.0
                for part in SPLIT_PARTS:
                    height = (entry[part][q] or 0.0) * 1e3
                    ax.bar(x, height, bottom=bottom, color=PART_COLORS[part], hatch=hatch,
                           edgecolor="white", label=part if not labels else None)
                    bottom += height
                labels.append(f"{cfg}\n{cls} {q}")
    if labels:
        ax.set_xticks(range(len(labels)), labels, fontsize="x-small", rotation=60)
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no split (the server did not report one)", ha="center",
                transform=ax.transAxes)
    ax.set(ylabel="ms", title="Where TTFT went: queue / tier / compute per residency class")
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
                                                              default=jsonable)
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
             ("TTFT split by residency", _plot_split(summaries)),
             ("Host link utilisation", _plot_link(timelines))]
    figures = "".join(f'<h2>{html.escape(title)}</h2><img src="data:image/png;base64,{data}" '
                      f'alt="{html.escape(title)}">' for title, data in plots)
    flags = "".join(f"<li><b>{html.escape(name)}</b>: {html.escape(f['message'])}</li>"
                    for name, s in summaries.items() for f in s["flags"])
    refused = "".join(
        f"<li><b>{html.escape(name)}</b> {html.escape(r['request'])}: "
        f"{html.escape(r['reason'])}</li>"
        for name, s in summaries.items() for r in s.get("refused", {}).get("requests", []))
    shown_meta = {k: v for k, v in meta.items() if k != "link_timeline"}
    doc = (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvtier bench</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th{text-align:left}pre{margin:0;text-align:left}img{max-width:100%}</style>"
        "</head><body><h1>kvtier bench</h1>"
        f"<h2>Summary</h2>{_html_table(summaries)}"
        f"<h2>Flags</h2><ul>{flags or '<li>none</li>'}</ul>"
        f"<h2>Refused requests (first {REFUSED_LISTED} per configuration)</h2>"
        f"<ul>{refused or '<li>none</li>'}</ul>"
        f"{figures}<h2>Run</h2>{_html_meta(shown_meta)}</body></html>\n"
    )
    atomic_write(path, doc)
