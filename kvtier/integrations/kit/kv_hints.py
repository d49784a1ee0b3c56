"""What a client asks of its request's KV beyond the request, through an engine's per-request
params (vLLM's `kv_transfer_params`), answered in the params the request ends with:

  kvtier_retention_s: N        keep its full blocks N seconds (-> N granted, or
                               "refused:<reason>": invalid, disabled, over_max, quota, full,
                               not_stored)
  kvtier_expect_return_s: N    the session comes back after about N seconds: its prefix is
                               staged up into host shortly before (-> N, or "refused:...")

A value no client means (negative, zero, NaN, infinite, a bool, a string) is refused
("refused:invalid"; a retention's counted with the tenant's other refusals) and the request
is served anyway. Staging happens in the engine's step
(`TierManager.stage_returns`): an engine that steps only when it has work (vLLM) stages a
due hint at its next step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.tier import BlockKey, TierManager

log = logging.getLogger(__name__)

RETENTION = "kvtier_retention_s"
EXPECT_RETURN = "kvtier_expect_return_s"
INVALID = "refused:invalid"


def seconds(value: object) -> float | None:
    """`value` as seconds a client can mean (a finite number > 0, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


class HintAnswers:
    """A finished request's asks answered by one `TierManager` (which stages the expected
    returns itself, `TierManager.stage_returns`)."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._warned: set[str] = set()  # the asks a bad value was logged for (once each)

    def answer(self, request_id: str, asks: Mapping[str, Any] | None, tenant: str,
               keys: Sequence[BlockKey], chunks: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The answers to a finished request's asks; `keys` (covering `chunks`) are its full
        blocks, handed to the tier already (stored, or still storing)."""
        if not isinstance(asks, Mapping):
            return {}
        out: dict[str, Any] = {}
        if RETENTION in asks:
            s = self._checked(RETENTION, asks[RETENTION])
            out[RETENTION] = self.manager.retain(keys, tenant, s).value  # None: counted
        if EXPECT_RETURN in asks:
            s = self._checked(EXPECT_RETURN, asks[EXPECT_RETURN])
            out[EXPECT_RETURN] = (INVALID if s is None
                                  else self.manager.expect(request_id, keys, chunks, s,
                                                           tenant).value)
        return out

    def _checked(self, name: str, value: object) -> float | None:
        s = seconds(value)
        if s is None and name not in self._warned:
            self._warned.add(name)
            log.warning("kvtier: %s=%r in kv_transfer_params is not a finite number of seconds "
                        "> 0; answered %r (logged once)", name, value, INVALID)
        return s
