"""The prompt cache as clients address it, for both APIs: where each cache breakpoint ends
in the rendered prompt's tokens (`breakpoint_tokens`), and what a request read from the
cache and wrote to it under each lifetime (`cache_usage`), from the engine's own counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.model.tokenizer import Tokenizer
from kvtier.output import RequestOutput
from kvtier.server.request_body import ApiError


def breakpoint_tokens(tokenizer: Tokenizer, text: str, ids: list[int],
                      pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Where each marked piece (a content part or block: its text, whether it carries a
    breakpoint) ends in the rendered prompt's tokens: the tokens of the text up to its end,
    as far as they agree with the whole prompt's (a token the cut would split is left out).
    The template renders the pieces' texts in order, so each is found after the one before."""
    out: list[int] = []
    if not any(marked for _, marked in pieces):
        return out
    cursor = 0
    for piece, marked in pieces:
        at = text.find(piece, cursor)
        if at < 0:
            if marked:
                raise ApiError(400, "a block's text is not in the prompt the chat template "
                                    "made; its cache breakpoint has no place")
            continue
        cursor = at + len(piece)
        if marked:
            head = tokenizer.encode(text[:cursor], add_special_tokens=False)
            n = 0
            while n < min(len(head), len(ids)) and head[n] == ids[n]:
                n += 1
            out.append(n)
    return out


@dataclass(frozen=True)
class CacheUsage:
    """Prompt tokens read from the cache (the device's prefix cache or restored from a
    tier) and written to it for a breakpoint, per lifetime label."""

    read: int
    written: int = 0
    written_by_ttl: dict[str, int] = field(default_factory=dict)


def cache_usage(out: RequestOutput, marks: Sequence[tuple[int, str]], block_size: int
                ) -> CacheUsage:
    """What `out` read, and of what it wrote to the cache past that, how many tokens lie
    before each breakpoint (`marks`: its tokens and lifetime label, in prompt order; the
    whole prompt for an implicit one). A breakpoint inside a block is kept to the token where
    the engine kept that block's part (`exact_breakpoints`: a tier took it), else to the last
    full block before it."""
    read = out.num_read_tokens
    published_end = read + out.num_cache_write_tokens
    return kept_usage(read, [
        (min(tokens if tokens in out.exact_breakpoints else tokens // block_size * block_size,
             published_end), ttl) for tokens, ttl in marks])


def kept_usage(read: int, kept: Sequence[tuple[int, str]]) -> CacheUsage:
    """Usage from what was read (the prompt's first `read` tokens) and how far each
    breakpoint keeps the prompt (`kept`: its end in tokens, its lifetime label): a
    breakpoint wrote the tokens between the end of what was read or kept before it and its
    own end (under vLLM, the connector says both: `integrations/vllm/cache_usage.py`)."""
    by_ttl: dict[str, int] = {}
    start = read
    for end, ttl in sorted(kept, key=lambda mark: mark[0]):
        if end > start:
            by_ttl[ttl] = by_ttl.get(ttl, 0) + end - start
            start = end
    return CacheUsage(read, sum(by_ttl.values()), by_ttl)
