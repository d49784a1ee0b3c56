"""What a cache reset does to the identity block keys are chained from (no vLLM needed): a
new identity every time, the operator's version when the file names a new one, else one of
this process alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.kit.epochs import ChainIdentity, read_identity_file
from kvtier.integrations.kit.identity import is_shared
from kvtier.tier import Fingerprint

FP = Fingerprint("weights-at-start", "arch", "bf16", 4, "")


def test_each_reset_moves_every_seed_to_a_new_unshared_identity() -> None:
    chain = ChainIdentity(FP)
    before = {salt: chain.seed(salt) for salt in ("", "tenant")}
    assert before[""] == FP.namespace("") and chain.shared
    first = chain.reset()
    assert not is_shared(first) and not chain.shared and chain.resets == 1
    after = {salt: chain.seed(salt) for salt in ("", "tenant")}
    assert all(after[s] != before[s] for s in before)
    chain.reset()
    assert chain.seed("") not in (before[""], after[""])  # and never back to an older one


def test_a_new_version_in_the_identity_file_is_shared_and_an_old_one_is_not(
        tmp_path: Path) -> None:
    # RL: the trainer writes the version it just loaded, then resets; every rollout worker
    # that loaded step-2 chains from "pinned:step-2" and shares; the same file again is not
    # trusted (the reset may follow a reload the file does not name yet)
    file = tmp_path / "version"
    file.write_text("step-1\n")
    start = Fingerprint("pinned:step-1", "arch", "bf16", 4, "")
    chain = ChainIdentity(start, str(file))
    file.write_text("step-2\n")
    assert chain.reset() == "pinned:step-2" and chain.shared
    other = ChainIdentity(Fingerprint("pinned:step-2", "arch", "bf16", 4, ""), str(file))
    assert other.seed("") == chain.seed("")  # another worker that started on step-2
    assert not is_shared(chain.reset())  # no new version: this process's own identity
    file.write_text("step-1")
    assert not is_shared(chain.reset())  # a version served before is never taken again


def test_an_unreadable_identity_file_at_a_reset_is_unshared(tmp_path: Path) -> None:
    chain = ChainIdentity(FP, str(tmp_path / "absent"))
    assert not is_shared(chain.reset())


@pytest.mark.parametrize("text, match", [
    ("", "must hold one line"), ("two\nlines", "must hold one line"),
    ("x" * 257, "must hold one line")])
def test_a_bad_identity_file_is_a_clear_error(tmp_path: Path, text: str, match: str) -> None:
    file = tmp_path / "version"
    file.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_identity_file(file)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_identity_file(tmp_path / "absent")
