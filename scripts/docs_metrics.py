"""The metrics reference in docs/operations.md, written from the counter catalog
(`kvtier/tier/catalog.py`) between its two markers, so the page never drifts from what is
exported; `--check` exits 1 where the page differs (the test suite runs it).

    python scripts/docs_metrics.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.tier import CATALOG, Family, Kind

PAGE = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN = "<!-- catalog: begin (scripts/docs_metrics.py writes this table) -->"
END = "<!-- catalog: end -->"


def name(family: Family, prefix: str, exported: str | None) -> str:
    if exported is None:
        return "-"
    suffix = "_total" if family.kind is Kind.COUNTER else ""
    return f"`{prefix}{exported}{suffix}`"


def table() -> str:
    lines = ["| `kvtier serve` | `vllm serve` | labels | what it counts |", "|---|---|---|---|"]
    for family in CATALOG:
        labels = ", ".join(label.value for label in family.labels) or "-"
        doc = family.doc.replace("|", "\\|")
        if family.per_rank_bytes:
            doc += " (under vLLM: every tensor-parallel rank's bytes)"
        if family.kind is Kind.GAUGE:
            doc += " (a gauge)"
        lines.append(f"| {name(family, 'kvtier_', family.serve)} | "
                     f"{name(family, 'vllm:kvtier_', family.vllm)} | {labels} | {doc} |")
    return "\n".join(lines)


def written(page: str) -> str:
    """`page` with the table between its markers replaced by the catalog's."""
    head, found, rest = page.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"{PAGE} lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}"


def main() -> None:
    page = PAGE.read_text()
    new = written(page)
    if "--check" in sys.argv[1:]:
        if new != page:
            print(f"{PAGE} differs from the counter catalog: run python scripts/docs_metrics.py",
                  file=sys.stderr)
            sys.exit(1)
        return
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
