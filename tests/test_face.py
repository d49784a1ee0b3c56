"""Clients see only the tier's face: import rules cannot see attribute chains, so this walks
the code outside `kvtier/tier/` (and the benchmarks) and fails on any `<...>.manager.X` or
`<...>.worker.X` whose X is not on the documented face of `TierManager` / `TierWorker`
(their module docstrings). A client that needs more asks for it on the face."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# kvtier/tier/books/manager.py's docstring, and the read-only facts a client sizes itself by
MANAGER_FACE = frozenset({
    "match", "allocated", "outcome", "store", "finished", "forget", "take_jobs", "apply",
    "report", "decide", "observe_prefill", "wait_presence", "busy", "below_host", "hands_off",
    "host_slots", "holds", "write_down_host", "config", "block_size", "block_bytes", "lossy",
    "close", "take_residency_changes", "reset", "prefetch", "answer", "retain",
    "expect", "stage_returns", "purge", "purge_tenant",
})
# kvtier/tier/worker.py's docstring
WORKER_FACE = frozenset({
    "submit", "poll", "wait", "wait_any", "wait_layer", "in_flight", "busy", "close",
    "flush", "report", "layout", "host_slots", "wait_fetches",
})
FACES = {"manager": MANAGER_FACE, "worker": WORKER_FACE}


def receiver(node: ast.expr) -> str | None:
    """The last name of an attribute's receiver: `engine.tier.manager` -> "manager"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def reach_throughs(source: str, rel: str) -> list[str]:
    """`file:line: .manager.attr` for every access past the face in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if not isinstance(node, ast.Attribute):
            continue
        face = FACES.get(receiver(node.value) or "")
        if face is not None and node.attr not in face:
            found.append(f"{rel}:{node.lineno}: .{receiver(node.value)}.{node.attr}")
    return found


def client_files() -> list[Path]:
    package = [p for p in (ROOT / "kvtier").rglob("*.py")
               if (ROOT / "kvtier" / "tier") not in p.parents]
    return sorted(package + list((ROOT / "benchmarks").glob("*.py")))


def test_no_client_reads_past_the_tiers_face() -> None:
    found = [hit for path in client_files()
             for hit in reach_throughs(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, "clients reading the tier's internals:\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "hits"), [
    ("engine.tier.manager.below.stats", 1),
    ("x = tier.worker.host.num_slots", 1),
    ("manager.report().host.used; worker.report().link", 0),
    ("self.manager.planner.decide(1, 2)", 1),
])
def test_the_walk_sees_a_reach_through(source: str, hits: int) -> None:
    assert len(reach_throughs(source, "benchmarks/probe.py")) == hits
