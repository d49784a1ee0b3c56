"""What a client asks of its request's KV beyond the request, through an engine's per-request
params (vLLM's `kv_transfer_params`), answered in the params the request ends with:

  kvtier_retention_s: N        keep its full blocks N seconds (-> N granted, or
                               "refused:<reason>": invalid, disabled, over_max, quota, full,
                               not_stored)
  kvtier_expect_return_s: N    the session comes back after about N seconds: its prefix is
                               staged up into host shortly before (-> N, or "refused:...")
  kvtier_cache_breakpoints: [[T, N], ...]   cache breakpoints (at most 4): the prompt's first
                               T tokens kept N seconds each (-> kvtier_cache_breakpoints_s:
                               [N or "refused:<reason>", ...], in order)
  kvtier_purge: true           when it ends, its blocks are erased from host and every tier
                               below (-> {"blocks", "host_blocks", "host_in_use", "erased"})

vLLM's typed KV hints (`Request.kv_hints`, an envelope of versioned actions) are read by
`hint_actions.py` and answered under `kvtier_kv_hints`, one answer per action.

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

from kvtier.integrations.kit.hint_actions import (
    ANSWER_KEY,
    Planned,
    answers,
    plan,
    with_actions,
)
from kvtier.tier import (
    MAX_PREFIXES,
    BlockKey,
    Hint,
    KvHints,
    PrefixRetention,
    TierManager,
    seconds,
)

log = logging.getLogger(__name__)

PREFIX = "kvtier_"  # each hint's key: kvtier_retention_s, kvtier_expect_return_s
BREAKPOINTS = "kvtier_cache_breakpoints"  # [[tokens, seconds], ...] -> ..._s: each answer
INVALID = "refused:invalid"


def parse(asks: Mapping[str, Any] | None, tenant: str) -> KvHints:
    """The tier's hints from a request's params (`tenant`: whose the request is); a value no
    client means is named in `invalid`, never raised: the request is served anyway."""
    if not isinstance(asks, Mapping):
        return KvHints(tenant)
    values: dict[str, float] = {}
    invalid = set()
    for hint in Hint:
        if PREFIX + hint.value in asks:
            value = seconds(asks[PREFIX + hint.value])
            if value is None:
                invalid.add(hint)
            else:
                values[hint.value] = value
    return KvHints(tenant, values.get(Hint.RETENTION.value),
                   values.get(Hint.EXPECT_RETURN.value), frozenset(invalid),
                   breakpoints(asks.get(BREAKPOINTS)))


def breakpoints(marks: Any) -> tuple[PrefixRetention, ...]:
    """`kvtier_cache_breakpoints`: [[tokens, seconds], ...] (a prompt's first `tokens` kept
    that long: what the middleware makes of a client's cache breakpoints); an entry no client
    means is kept as one the tier refuses (`invalid`), so every entry gets its answer."""
    if not isinstance(marks, list):
        return ()
    out = []
    for mark in marks[:MAX_PREFIXES]:
        ok = (isinstance(mark, list) and len(mark) == 2 and isinstance(mark[0], int)
              and not isinstance(mark[0], bool) and mark[0] >= 0)
        held = seconds(mark[1]) if ok else None
        out.append(PrefixRetention(mark[0], held) if ok and held is not None
                   else PrefixRetention(0, math.nan))
    return tuple(out)


class HintAnswers:
    """A finished request's asks answered by one `TierManager` (which stages the expected
    returns itself, `TierManager.stage_returns`)."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._warned: set[Hint] = set()  # the asks a bad value was logged for (once each)

    def answer(self, request_id: str, asks: Mapping[str, Any] | None, tenant: str,
               keys: Sequence[BlockKey], chunks: Sequence[Sequence[int]],
               envelope: Any = None, prompt_tokens: int = 0, groups: int = 1,
               read_tokens: int | None = None) -> dict[str, Any]:
        """The answers to a finished request's asks and to the actions of its KV hints
        envelope (`hint_actions.py`; `prompt_tokens` and `groups` read its ranges); `keys`
        (covering `chunks`) are its full blocks, in token order, handed to the tier already
        (stored, or still storing). With `read_tokens` (the prompt tokens it did not compute:
        the engine's own prefix hit and the tier's restore), a request that asked retention
        or breakpoints is also told what it read and how far each grant keeps the prompt
        (`kvtier_read_tokens`, `kvtier_retention_kept`, `kvtier_cache_breakpoints_kept`):
        the usage APIs report (`integrations/vllm/cache_usage.py`)."""
        hints = parse(asks, tenant)
        own = len(hints.prefixes)
        planned = plan(envelope, prompt_tokens, self.manager.block_size, groups)
        hints, planned = with_actions(hints, planned)
        for hint in hints.invalid - self._warned:
            self._warned.add(hint)
            log.warning("kvtier: %s%s=%r in kv_transfer_params is not a finite number of "
                        "seconds > 0; answered %r (logged once)", PREFIX, hint.value,
                        asks[PREFIX + hint.value] if asks else None, INVALID)
        reply = self.manager.answer(request_id, hints, keys, chunks)
        out: dict[str, Any] = {PREFIX + hint.value: value
                               for hint, value in reply.answers().items()
                               if not (hint is Hint.EXPECT_RETURN and _by_action(planned))}
        if own:
            out[BREAKPOINTS + "_s"] = [g.value for g in reply.prefixes[:own]]
        if asks is not None and asks.get(PREFIX + "purge") is True:
            out[PREFIX + "purge"] = self._purge(keys)
        if read_tokens is not None and (own or hints.asks(Hint.RETENTION)):
            bs = self.manager.block_size
            kept = min(len(chunks) // max(1, groups), prompt_tokens // bs) * bs
            out[PREFIX + "read_tokens"] = read_tokens
            if reply.retention is not None:
                out[PREFIX + "retention_kept"] = kept if reply.retention.refused is None else 0
            if own:
                out[BREAKPOINTS + "_kept"] = [
                    min(p.tokens // bs * bs, kept) if g.refused is None else 0
                    for p, g in zip(hints.prefixes[:own], reply.prefixes[:own])]
        if planned:
            out[ANSWER_KEY] = {"message_id": str(getattr(envelope, "message_id", ""))[:128],
                               "actions": answers(planned, reply, own)}
        return out


    def _purge(self, keys: Sequence[BlockKey]) -> dict[str, Any]:
        """`kvtier_purge: true`: the request's blocks (its namespace's, every group's) erased
        from host and every tier below, as `DELETE /v1/kv` erases them in kvtier serve; the
        engine's own device cache is the engine's."""
        purged = self.manager.purge(keys)
        return {"blocks": len(set(keys)), "host_blocks": purged.host_blocks,
                "host_in_use": purged.host_in_use,
                "erased": {m.value: n for m, n in purged.below.items()}}


def _by_action(planned: Sequence[Planned]) -> bool:
    """Whether the expected return was asked by an action (answered there, not as a
    kv_transfer_params ask)."""
    return any(p.after_s is not None and p.rejected is None for p in planned)
