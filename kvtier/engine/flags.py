"""Engine knobs as command-line flags, shared by every subcommand that builds an engine."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.config import knob_fields


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine knob (`--max-num-seqs` for `max_num_seqs`), defaults from the config."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF directory, .gguf file, preset name (tiny); default: SmolLM2-135M")
    for f in knob_fields():
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            group.add_argument(flag, dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction)
            continue
        parse = (json_object if kind.startswith("dict") else float if kind.startswith("float")
                 else int if kind.startswith("int") else str)
        group.add_argument(flag, dest=f.name, type=parse, default=None,
                           help=f"default: {f.default}")


def json_object(text: str) -> dict[str, Any]:
    """A flag whose knob is an object (`--kv-stores '{"fs": {"path": "/mnt/kv"}}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected, as {\"name\": {...}}")
    return value


def engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in knob_fields()} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}
