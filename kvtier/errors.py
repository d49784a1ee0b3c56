"""Typed errors: every user mistake raises one of these with the bad value and the fix."""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError):
    """A knob or engine setting is invalid (bad value, conflicting knobs, too large)."""


class ModelLoadError(KvtierError):
    """A model path is missing, unreadable, or holds something kvtier cannot run."""


class RequestError(KvtierError):
    """A request is invalid: empty prompt, bad sampling parameter, prompt too long."""


class CapacityError(KvtierError):
    """The engine cannot hold a request at all (it needs more blocks than the pool has)."""
