"""The command line as a user runs it: JSON output, and errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_generate_json_on_the_tiny_preset() -> None:
    r = kvtier("generate", "hello there", "--model", "tiny", "--max-tokens", "5", "--json",
               "--num-device-blocks", "16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "ttft_s", "tokens_per_s"}
    assert 1 <= len(out["token_ids"]) <= 5 and out["ttft_s"] > 0


def test_missing_model_path_is_a_clear_error() -> None:
    r = kvtier("generate", "hi", "--model", "/nowhere/model.gguf")
    assert r.returncode == 2
    assert "/nowhere/model.gguf" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_knob_value_is_a_clear_error() -> None:
    r = kvtier("generate", "hi", "--model", "tiny", "--block-size", "3")
    assert r.returncode == 2 and "block_size=3" in r.stderr and "Traceback" not in r.stderr
    r = kvtier("generate", "hi", "--model", "tiny", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens=0" in r.stderr


def test_every_command_has_a_working_help() -> None:
    from kvtier.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name, command in [("", parser), *sub.choices.items()]:
        text = command.format_help()  # what `kvtier NAME --help` prints, without exiting
        assert "usage:" in text and len(text) > 100, name


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kvtier ARGS` run by its own `main` here: (exit code, stderr). For the errors caught
    before anything loads, each a second of a fresh interpreter's imports saved; an
    exception that is no KvtierError escapes and fails the test, as a traceback would."""
    from kvtier.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_bad_tenant_quotas_are_clear_errors(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": "alice"}))
    r = kvtier("serve", "--model", "tiny", "--api-keys-file", str(keys),
               "--kv-tenant-quotas", '{"bob": {"host": 1}}')
    assert r.returncode == 2 and "'bob', which no API key is for" in r.stderr, r.stderr
    assert "the tenants are: alice" in r.stderr and "Traceback" not in r.stderr
    # without keys a named quota could match no request (a salt is no tenant unless the
    # operator says its router sets it), and keys with a tenant header are one too many
    for args, said in ((("--kv-tenant-quotas", '{"bob": {"host": 1}}'),
                        "kv_tenant_quotas names 'bob', but nothing names a request's tenant"),
                       (("--api-keys-file", str(keys), "--tenant-header", "X-Tenant"),
                        "give API keys (--api-key, --api-keys-file) or --tenant-header"),
                       (("--kv-tenant-from", "prompt_cache_key"),
                        "kv_tenant_from='prompt_cache_key' is not one of none, cache_salt")):
        code, err = in_process(capsys, "serve", "--model", "tiny", *args)
        assert code == 2 and said in err, err
    for knob, value, said in (
            ("--kv-tenant-quota", '{"gpu": 1}', "names the tier 'gpu'"),
            ("--kv-tenant-quota", '{"host": -1}', "must be a finite number of GiB"),
            ("--kv-tenant-quotas", '{"": {"host": 1}}', "a non-empty string"),
            ("--kv-retention-max-s", "-5", "kv_retention_max_s=-5")):
        code, err = in_process(capsys, "generate", "hi", "--model", "tiny",
                               "--kv-offloading-size", "0.01", knob, value)
        assert code == 2 and said in err, err
