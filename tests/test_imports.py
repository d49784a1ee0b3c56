"""Import rules import-linter cannot see: vLLM and SGLang (not installed beside kvtier's own
tests) are imported only by their own glue under kvtier/integrations, and plain `import
kvtier` never imports them."""

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


def test_each_engine_is_imported_only_by_its_own_glue() -> None:
    for engine, glue in (("vllm", "connector.py"), ("sglang", "storage.py")):
        offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if engine in imported_roots(p)
                     and p.parent != PACKAGE / "integrations" / engine]
        assert offenders == [], engine
        assert engine in imported_roots(PACKAGE / "integrations" / engine / glue)


def test_import_kvtier_and_the_engine_never_import_vllm() -> None:
    code = ("import sys, kvtier, kvtier.llm, kvtier.tier, kvtier.integrations; "
            "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_module_that_moved_into_its_folder_still_imports_by_its_old_path() -> None:
    # a fresh interpreter: the old path first, then the new one, one module under both names
    code = """
import importlib, kvtier
for old, new in kvtier.MOVED.items():
    a = importlib.import_module(old)
    b = importlib.import_module(new)
    assert a is b and b.__spec__.name == new, (old, new, b.__spec__.name)
from kvtier.metrics import Metrics
from kvtier.server.metrics import Metrics as Same
assert Metrics is Same
from kvtier.stats import RequestLog, engine_stats
from kvtier.flags import add_engine_args
from kvtier.selftest import run_selftest
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (PACKAGE / "metrics.py").exists() and (PACKAGE / "server" / "metrics.py").exists()
