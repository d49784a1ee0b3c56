"""docs/architecture.md stays true: every module path it names exists, and every module of
the package is named in it, by file name (a new file is described where a newcomer looks)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "kvtier"
TOP = ("tier", "engine", "model", "server", "bench", "plan", "cache", "integrations")


def test_every_module_path_the_doc_names_exists() -> None:
    named = set(re.findall(rf"`((?:{'|'.join(TOP)})/[\w./]+\.py)`", DOC))
    assert named, "the pattern found no path: the doc's style changed"
    stale = sorted(p for p in named if not (PACKAGE / p).exists())
    assert stale == [], f"docs/architecture.md names files that are gone: {stale}"


def test_every_module_of_the_package_is_named() -> None:
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(PACKAGE)) for p in modules if p.name not in DOC)
    assert missing == [], f"modules docs/architecture.md does not describe: {missing}"
