"""Import rules import-linter cannot see: vLLM (not installed beside kvtier's own tests) is
imported only under kvtier/integrations, and plain `import kvtier` never imports it."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_vllm_is_imported_only_by_the_integration() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "vllm" in imported_roots(p) and "integrations" not in p.parts]
    assert offenders == []
    assert "vllm" in imported_roots(PACKAGE / "integrations" / "vllm" / "connector.py")


def test_import_kvtier_and_the_engine_never_import_vllm() -> None:
    code = ("import sys, kvtier, kvtier.llm, kvtier.tier, kvtier.integrations; "
            "assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
