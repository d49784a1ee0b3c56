"""Prefill on one engine, decode on another, through a shared store (Redis/Valkey, a shared
directory), in vLLM's P/D convention, as a router (llm-d, Dynamo, vLLM's toy proxy) sends it:

  prefill request   kv_transfer_params {"do_remote_decode": true}, max_tokens 1
  its answer        {"do_remote_prefill": true, "do_remote_decode": false,
                     "kvtier_handoff_tokens": N}   the prompt's first N tokens, whose blocks
                                                   its engine writes to the shared store
  decode request    those params, sent on to the other engine (it may add
                    "kvtier_handoff_wait_s": S, how long it waits at most)
  any answer        {"kvtier_handoff_tokens": N} where a shared store is below host: a next
                    turn sent to another engine with {"do_remote_prefill": true,
                    "kvtier_handoff_tokens": N} waits there for this turn's last writes

A decode request with `do_remote_prefill` waits for the producer's blocks (`tier.Handoff`)
rather than recomputing what is about to land; one sent before the prefill answered (no
`kvtier_handoff_tokens`: the router sent both at once) waits for every full block of its
prompt. Its wait is bounded by `kvtier_handoff_wait_s`, else the connector's
`kv_handoff_wait_s`, else the planner's time to recompute what has not come. A producer
with no shared store below host answers `do_remote_prefill: false`: there is nothing to
wait for, the decode computes its prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.tier import Handoff, seconds

REMOTE_DECODE = "do_remote_decode"  # a prefill whose decode runs elsewhere
REMOTE_PREFILL = "do_remote_prefill"  # a decode whose prefill ran elsewhere
TOKENS = "kvtier_handoff_tokens"
WAIT_S = "kvtier_handoff_wait_s"
INVALID = "kvtier_handoff_invalid"  # the fields no client means, named in the answer


def expected(params: Mapping[str, Any] | None, wait_s: float | None) -> Handoff | None:
    """What a decode request expects another engine to have written (None: not a decode
    whose prefill ran elsewhere); `wait_s`: the connector's bound when the request sets
    none. A value no client means is ignored (the default stands) and named by `invalid`."""
    if not isinstance(params, Mapping) or params.get(REMOTE_PREFILL) is not True:
        return None
    tokens = params.get(TOKENS)
    bound = seconds(params[WAIT_S]) if WAIT_S in params else None
    return Handoff(tokens if _count(tokens) else None, wait_s if bound is None else bound)


def invalid(params: Mapping[str, Any] | None) -> list[str]:
    """The handoff fields of a decode's params that no client means (answered, not raised:
    the request is served, waiting as if they were unset)."""
    if not isinstance(params, Mapping) or params.get(REMOTE_PREFILL) is not True:
        return []
    bad = [TOKENS] if TOKENS in params and not _count(params[TOKENS]) else []
    return bad + ([WAIT_S] if WAIT_S in params and seconds(params[WAIT_S]) is None else [])


def handed(params: Mapping[str, Any] | None, tokens: int, shared: bool) -> dict[str, Any]:
    """What a finished request answers where a shared store is below host (`shared`): the
    first `tokens` of its sequence are on their way there, for whichever engine a router
    sends its next turn to; a prefill asked to hand off (`do_remote_decode`) answers what
    its decode sends on, `do_remote_prefill` false where there is no shared store."""
    answer: dict[str, Any] = {TOKENS: tokens} if shared else {}
    if isinstance(params, Mapping) and params.get(REMOTE_DECODE) is True:
        answer.update({REMOTE_PREFILL: shared and tokens > 0, REMOTE_DECODE: False,
                       TOKENS: tokens if shared else 0})
    return answer


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
