"""The identity the connector chains block keys from, and what vLLM's cache reset does to it.

  seed(salt) -> BlockKey     the chain's seed for a request's salt (cache_salt, LoRA)
  reset() -> str             a new weights identity from now on (what it is, for the log)
  identity, shared, resets   the identity in force, whether another process may share it,
                             how many resets this process has seen

vLLM calls the connector's `reset_cache` when asked to forget its prefix cache
(`reset_prefix_cache(reset_connector=True)`, `pause_generation(clear_cache=True)`, sleep):
what RL weight syncs and in-place reloads (`collective_rpc("reload_weights")`) must call, since
vLLM's weights may have changed under the cache. kvtier cannot see weights that change in
memory, so after a reset it does not pretend to know them: keys are chained from a new
identity, so no block stored before the reset (on host, disk or Redis, by this process or any
other) is ever found again, and no block computed after it is stored under the old identity.
The new identity is the operator's (`model_identity_file`, re-read at each reset: the
version a weight sync just loaded) when the file names one this process has not used yet;
otherwise it is unshared (`identity.unshared_identity`): blocks are still cached for this
process's own requests, never found by another process or after a restart.

Blocks below host keep the header namespace they were written with (the deployment's at
start: the worker's stores are built once); only the keys move. A key chained from another
identity is never asked for, so the header never has to tell them apart. With
`model_identity_file` that header namespace leaves the weights' identity to the keys
(`DeploymentPlan.namespace`), so a fresh process started on the version a reset moved to
reads what the reset process stored.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.integrations.kit.identity import is_shared, unshared_identity
from kvtier.tier import BlockKey, Fingerprint

log = logging.getLogger(__name__)
MAX_IDENTITY_CHARS = 256


def read_identity_file(path: str | Path) -> str:
    """The operator's identity of the weights now loaded: the file's text, stripped;
    ConfigError when it is missing, empty, too long or not text."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model_identity_file={str(path)!r} cannot be read: {e}; write the "
                          "version of the weights vLLM serves into it") from None
    if not text or len(text) > MAX_IDENTITY_CHARS or "\n" in text:
        raise ConfigError(f"model_identity_file={str(path)!r} must hold one line of 1-"
                          f"{MAX_IDENTITY_CHARS} characters naming the weights' version "
                          f"(it holds {len(text)} characters)")
    return text


class ChainIdentity:
    """The fingerprint block keys are chained from, moved to a new identity by each reset."""

    def __init__(self, fingerprint: Fingerprint, identity_file: str | None = None) -> None:
        self._start = fingerprint
        self._current = fingerprint
        self._file = identity_file
        self._used = {fingerprint.weights_digest}  # a file identity is taken once
        self.resets = 0

    @property
    def identity(self) -> str:
        return self._current.weights_digest

    @property
    def shared(self) -> bool:
        """Whether another process may hold blocks of this identity (and find ours)."""
        return is_shared(self.identity)

    def seed(self, salt: str = "") -> BlockKey:
        return self._current.namespace(salt)

    def reset(self) -> str:
        """Chain every key from a new identity from now on; that identity."""
        self.resets += 1
        new = None
        if self._file is not None:
            try:
                named = "pinned:" + read_identity_file(self._file)
            except ConfigError as e:
                log.warning("kvtier: %s", e)
            else:
                if named in self._used:
                    log.warning("kvtier: the KV cache was reset but model_identity_file still "
                                "names %r, which this process served before the reset: kvtier "
                                "cannot tell the weights now loaded, so it caches under an "
                                "identity of this process alone until a reset finds a new "
                                "version in the file", named.removeprefix("pinned:"))
                else:
                    new = named
        if new is None:
            new = unshared_identity(f"reset{self.resets}")
        self._used.add(new)
        self._current = replace(self._start, weights_digest=new)
        if is_shared(new):
            log.info("kvtier: the KV cache was reset (reset %d); blocks are now keyed by the "
                     "weights version %r from model_identity_file", self.resets,
                     new.removeprefix("pinned:"))
        elif self._file is None:
            log.warning("kvtier: the KV cache was reset (reset %d): vLLM's weights may have "
                        "changed in place, which kvtier cannot see. Nothing cached before is "
                        "served again; from now on blocks are cached for this process alone "
                        "(never shared through disk or Redis, never found after a restart). "
                        "Give model_identity_file (the version each weight sync loads) to "
                        "share them", self.resets)
        return new
