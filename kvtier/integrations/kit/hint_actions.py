"""vLLM's typed KV hints (`Request.kv_hints`: an envelope of versioned actions an
orchestrator attaches to a request) as the tier's hints, each action answered in the params
the request ends with (`kvtier_kv_hints`): accepted, clipped (narrowed, and why), deferred
(it runs later) or rejected (and why). The actions kvtier executes, version "1":

  kv.retain    {"ttl_s": N, "token_range": [0, END]}   keep the prompt's blocks up to END
               (the whole prompt without a range) N seconds in every tier that holds them,
               counted against the request's tenant (a prefix: a range starts at 0)
  kv.prefetch  {"after_s": N}                            the session comes back in about N
               seconds: its prefix is staged up into host shortly before (deferred)

Anything else, or a payload kvtier cannot read, is rejected alone: the request and the
other actions are served. vLLM's own retain keeps GPU blocks; this one keeps them in host,
disk and the shared stores."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.tier import HintReply, KvHints, PrefixRetention, seconds

RETAIN, PREFETCH = "kv.retain", "kv.prefetch"
VERSION = "1"
MAX_ACTIONS = 16  # per request: more are rejected, the first ones served
ANSWER_KEY = "kvtier_kv_hints"


class Status(str, enum.Enum):
    """What became of one action."""

    ACCEPTED = "accepted"
    CLIPPED = "clipped"  # served over less than was asked (the reason says what)
    DEFERRED = "deferred"  # it runs later (a prefetch before the session's return)
    REJECTED = "rejected"


@dataclass(frozen=True)
class Planned:
    """One action as read: what it asks of the tier (a prefix kept, a return expected), or
    why it is rejected before the tier is asked."""

    action_id: str
    action_type: str
    prefix: PrefixRetention | None = None
    after_s: float | None = None
    clipped: str | None = None  # why a retain covers less than its range
    rejected: str | None = None


def plan(envelope: Any, prompt_tokens: int, block_size: int, groups: int = 1
         ) -> list[Planned]:
    """Each action of `envelope` (vLLM's `KvHintsEnvelope`, or None) read against the
    request's prompt; `groups`: the model's KV cache groups (a range shorter than the
    prompt needs one: several groups keep different blocks of the same tokens)."""
    actions = getattr(envelope, "actions", None) or []
    out: list[Planned] = []
    for n, action in enumerate(actions):
        action_id = str(getattr(action, "action_id", n))[:128]
        kind = str(getattr(action, "action_type", ""))[:64]
        if n >= MAX_ACTIONS:
            out.append(Planned(action_id, kind, rejected=f"over {MAX_ACTIONS} actions"))
        elif str(getattr(action, "action_version", "")) != VERSION:
            out.append(Planned(action_id, kind, rejected=f"version "
                               f"{getattr(action, 'action_version', None)!r} of {kind!r} is "
                               f"not supported (kvtier reads version {VERSION!r})"))
        elif kind == RETAIN:
            out.append(_retain(action_id, getattr(action, "payload", None), prompt_tokens,
                               block_size, groups))
        elif kind == PREFETCH:
            out.append(_prefetch(action_id, getattr(action, "payload", None)))
        else:
            out.append(Planned(action_id, kind, rejected=f"unknown action type {kind!r} "
                               f"(kvtier executes {RETAIN!r} and {PREFETCH!r})"))
    return out


def _retain(action_id: str, payload: Any, prompt_tokens: int, block_size: int,
            groups: int) -> Planned:
    if not isinstance(payload, dict):
        return Planned(action_id, RETAIN, rejected="payload must be an object")
    ttl = seconds(payload.get("ttl_s"))
    if ttl is None:
        return Planned(action_id, RETAIN, rejected="ttl_s must be a finite number of seconds "
                       "> 0")
    span = payload.get("token_range", [0, prompt_tokens])
    if not (isinstance(span, list) and len(span) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) for t in span)):
        return Planned(action_id, RETAIN, rejected="token_range must be [start, end], two "
                       "integers")
    start, end = span
    if start != 0 or end <= start:
        return Planned(action_id, RETAIN, rejected="token_range must be a prefix: [0, end] "
                       "with end > 0 (a block is kept with the blocks before it)")
    why = []
    if end > prompt_tokens:
        end = prompt_tokens
        why.append(f"the prompt ends at token {prompt_tokens}")
    if end < prompt_tokens and groups > 1:
        return Planned(action_id, RETAIN, rejected="a range shorter than the prompt needs a "
                       f"model of one KV cache group (this one has {groups})")
    whole = end // block_size * block_size
    if whole == 0:
        return Planned(action_id, RETAIN, rejected=f"the range holds no whole block of "
                       f"{block_size} tokens")
    if whole < end:
        why.append(f"whole blocks of {block_size} tokens: up to token {whole}")
    return Planned(action_id, RETAIN, PrefixRetention(whole, ttl),
                   clipped="; ".join(why) or None)


def _prefetch(action_id: str, payload: Any) -> Planned:
    after = seconds(payload.get("after_s")) if isinstance(payload, dict) else None
    if after is None:
        return Planned(action_id, PREFETCH, rejected="after_s must be a finite number of "
                       "seconds > 0")
    return Planned(action_id, PREFETCH, after_s=after)


def with_actions(hints: KvHints, planned: Sequence[Planned]) -> tuple[KvHints,
                                                                        list[Planned]]:
    """`hints` with what the actions ask added (their prefixes after any the request's own
    params asked); a prefetch where the params ask an expected return already, or a second
    one, is rejected."""
    prefixes = list(hints.prefixes)
    after = hints.expect_return_s
    checked = []
    for p in planned:
        if p.rejected is None and p.after_s is not None:
            if after is not None or hints.invalid:
                p = replace(p, rejected="an expected return is asked already (one per "
                                        "request)")
            else:
                after = p.after_s
        if p.rejected is None and p.prefix is not None:
            prefixes.append(p.prefix)
        checked.append(p)
    return replace(hints, prefixes=tuple(prefixes), expect_return_s=after), checked


def answers(planned: Sequence[Planned], reply: HintReply, own_prefixes: int = 0
            ) -> list[dict[str, Any]]:
    """Each action's answer, in order, from what the tier granted (`own_prefixes`: the
    breakpoints the request's params asked, answered before the actions' in `reply`)."""
    grants = iter(reply.prefixes[own_prefixes:])
    out = []
    for p in planned:
        answer: dict[str, Any] = {"action_id": p.action_id, "action_type": p.action_type}
        grant = None
        if p.rejected is None:
            grant = next(grants, None) if p.prefix is not None else reply.expect_return
        if p.rejected is not None or grant is None:
            answer.update(status=Status.REJECTED.value, reason=p.rejected or "not answered")
        elif grant.refused is not None:
            answer.update(status=Status.REJECTED.value, reason=grant.refused.value)
        elif p.prefix is not None:
            answer.update(status=(Status.CLIPPED if p.clipped else Status.ACCEPTED).value,
                          ttl_s=grant.seconds, tokens=p.prefix.tokens, blocks=grant.blocks,
                          **({"reason": p.clipped} if p.clipped else {}))
        else:
            answer.update(status=Status.DEFERRED.value, after_s=grant.seconds)
        out.append(answer)
    return out
