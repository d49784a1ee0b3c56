"""What kvtier's vLLM connector uses of vLLM, checked against the vLLM on the path (the CPU
build the tests run, or a newer wheel's Python files laid over it by `vllm_overlay.sh`):

  python scripts/vllm_conformance.py [--expect VERSION] [--json FILE]

0. the connector accepts this vLLM at start (`settings.SUPPORTED_VLLM`);
1. every `vllm` name kvtier's integration imports resolves;
2. the connector has no abstract method left, and each hook it overrides has the base
   class's parameters (names and kinds, in order);
3. each attribute kvtier reads from vLLM's objects (requests, scheduler output, KV cache
   config and specs, KV events) is still one of theirs.

Prints a table and exits 1 on any mismatch, naming it. This is no forward pass: a newer
vLLM's GPU build cannot run here, but what kvtier calls and reads is Python and can be
checked (what could not be imported is said, not skipped silently)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GLUE = ROOT / "kvtier" / "integrations" / "vllm"

# what kvtier reads off vLLM's objects (kvtier/integrations/vllm/*.py), by class; a name
# ending in "?" is read with a fallback for the versions that lack it (said, not a problem)
READS: dict[str, tuple[str, ...]] = {
    "vllm.v1.request:Request": (
        "request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
        "kv_transfer_params", "cache_salt", "block_hashes", "lora_request", "mm_features",
        "prompt_embeds", "session_id", "kv_hints?"),
    "vllm.v1.core.sched.output:SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
        "total_num_scheduled_tokens", "kv_connector_metadata"),
    "vllm.v1.core.sched.output:CachedRequestData": (
        "req_ids", "new_block_ids", "resumed_req_ids?"),
    "vllm.v1.kv_cache_interface:KVCacheConfig": (
        "num_blocks", "kv_cache_groups", "hash_block_size"),
    "vllm.v1.kv_cache_interface:AttentionSpec": (
        "block_size", "num_kv_heads", "head_size", "dtype"),
    "vllm.distributed.kv_events:BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "vllm.distributed.kv_events:BlockRemoved": ("block_hashes", "medium"),
    # the connector's own config: its extra config and the kv_role it honours
    "vllm.config:KVTransferConfig": (
        "kv_connector_extra_config", "is_kv_producer", "is_kv_consumer"),
}
CONNECTOR = "kvtier.integrations.vllm.connector:KvtierConnector"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"


def load(entry: str) -> Any:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def imported_names() -> list[str]:
    """Every `from vllm... import X` (TYPE_CHECKING ones too) in kvtier's vLLM glue."""
    out = set()
    for path in sorted(GLUE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "vllm":
                out.update(f"{node.module}:{a.name}" for a in node.names)
    return sorted(out)


def read_with_fallback() -> set[str]:
    """The attribute names kvtier's vLLM glue reads as `getattr(obj, "name", default)`."""
    out = set()
    for path in sorted(GLUE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "getattr" and len(node.args) == 3 and \
                    isinstance(node.args[1], ast.Constant):
                out.add(str(node.args[1].value))
    return out


def has(cls: type, name: str) -> bool:
    """Whether instances of `cls` carry `name`: a class attribute or property, a dataclass
    or msgspec field, or an attribute its code assigns (`self.name = ...`)."""
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):
        return True
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{name} " in source or f"self.{name}:" in source or \
                f"self.{name}=" in source:
            return True
    return False


def signature_problems(base: type, ours: type) -> list[str]:
    """The hooks `ours` overrides whose parameters differ from `base`'s, and any abstract
    method left."""
    problems = [f"abstract method left: {name}"
                for name in sorted(getattr(ours, "__abstractmethods__", ()))]
    for name, theirs in vars(base).items():
        mine = vars(ours).get(name)
        if mine is None or name.startswith("__"):
            continue
        theirs, mine = (getattr(f, "__func__", f) for f in (theirs, mine))
        if not (callable(theirs) and callable(mine)):
            continue
        want = [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(mine).parameters.values()]
        if want != got:
            problems.append(f"{name}: vLLM's takes ({', '.join(n for n, _ in want)}), "
                            f"kvtier's ({', '.join(n for n, _ in got)})")
    return problems


def check() -> dict[str, Any]:
    import vllm

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.settings import check_vllm_version

    report: dict[str, Any] = {"vllm": vllm.__version__, "problems": [], "followed": [],
                              "checked": 1}
    problems: list[str] = report["problems"]
    try:
        check_vllm_version(vllm.__version__)  # the connector must accept it at start
    except ConfigError as e:
        problems.append(str(e))
    for entry in imported_names():
        report["checked"] += 1
        try:
            load(entry)
        except (ImportError, AttributeError) as e:
            problems.append(f"import {entry.replace(':', ' ')}: {type(e).__name__}: {e}")
    try:
        base, ours = load(BASE), load(CONNECTOR)
    except (ImportError, AttributeError) as e:
        problems.append(f"the connector does not import: {type(e).__name__}: {e}")
    else:
        report["checked"] += sum(1 for n in vars(base) if n in vars(ours))
        problems += signature_problems(base, ours)
    fallbacks = read_with_fallback()
    for entry, names in READS.items():
        try:
            cls = load(entry)
        except (ImportError, AttributeError) as e:
            problems.append(f"{entry}: {type(e).__name__}: {e}")
            continue
        for name in names:
            report["checked"] += 1
            optional = name.endswith("?")
            if not has(cls, name.rstrip("?")):
                gone = f"{entry.split(':')[1]}.{name.rstrip('?')} is gone"
                if optional and name.rstrip("?") in fallbacks:
                    report["followed"].append(gone + " (kvtier reads it with a fallback)")
                else:
                    problems.append(gone)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expect", help="the vLLM version that must be on the path")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = check()
    if args.expect and report["vllm"] != args.expect:
        report["problems"].insert(0, f"vLLM {report['vllm']} is on the path, not "
                                     f"{args.expect} (run scripts/vllm_overlay.sh)")
    print(f"vLLM {report['vllm']}: {report['checked']} things kvtier uses checked, "
          f"{len(report['problems'])} problem(s)")
    for problem in report["problems"]:
        print(f"  - {problem}")
    for change in report["followed"]:
        print(f"  followed: {change}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
