"""Anthropic's Messages request (`POST /v1/messages`) as kvtier takes it: system and
messages of text blocks, `cache_control` on a block or once at the top level (automatic
caching: the last block), `ttl` 5m | 1h. Strict as `protocol.py` is; what kvtier does not
implement (tools, images, thinking) is refused by name, never silently dropped."""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.errors import RequestError
from kvtier.sequence import SamplingParams
from kvtier.server.protocol import refuse_unsupported
from kvtier.tier import MAX_PREFIXES, KvHints, PrefixRetention

# Anthropic's cache lifetimes: each is a retention of that long in every tier holding the
# blocks; a hit renews it
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}
# what Anthropic's API has that kvtier does not implement, with the value that means "off"
UNSUPPORTED: dict[str, Any] = {"tools": [], "tool_choice": None, "thinking": None,
                               "container": None, "mcp_servers": []}


def check_controls(controls: list[CacheControl]) -> None:
    """Anthropic's rules for a request's cache_control blocks, in prompt order (the
    top-level one included): at most four, and no longer lifetime after a shorter one;
    RequestError otherwise."""
    if len(controls) > MAX_PREFIXES:  # the automatic one included
        raise RequestError(f"a maximum of {MAX_PREFIXES} blocks with cache_control may "
                           f"be provided (the top-level one included); found {len(controls)}")
    for before, after in pairwise(controls):
        if CACHE_TTL_S[after.ttl] > CACHE_TTL_S[before.ttl]:
            raise RequestError("a cache_control with ttl='1h' cannot come after one with "
                               "ttl='5m': longer lifetimes must come first")


class CacheControl(BaseModel):
    """`{"type": "ephemeral", "ttl": "5m" | "1h"}`: the prompt up to the end of its block is
    kept at least `ttl` (5 minutes unless said)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    """A content block; only `text` ones are served (any other type is refused by name)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None

    def checked(self, where: str) -> str:
        if self.type != "text" or self.text is None:
            raise RequestError(f"{where}: a {self.type!r} block is not supported; kvtier "
                               "serves text blocks ({\"type\": \"text\", \"text\": ...})")
        if self.cache_control is not None and not self.text:
            raise RequestError(f"{where}.cache_control: an empty text block cannot be cached")
        return self.text


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(BaseModel):
    """The body of `POST /v1/messages`."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    cache_control: CacheControl | None = None  # automatic caching: the last block
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    cache_salt: str | None = None  # kvtier's (as vLLM's): a namespace of the caller's own

    def pieces(self) -> list[tuple[str, str, CacheControl | None]]:
        """(role, text, its cache_control) of each block in prompt order (the system's
        first), the top-level cache_control on the last block; RequestError for a block
        kvtier cannot serve, too many breakpoints, or a 1h one after a 5m one."""
        out: list[tuple[str, str, CacheControl | None]] = []
        system = [] if self.system is None else (
            [TextBlock(type="text", text=self.system)] if isinstance(self.system, str)
            else self.system)
        for i, block in enumerate(system):
            out.append(("system", block.checked(f"system.{i}"), block.cache_control))
        for i, m in enumerate(self.messages):
            blocks = ([TextBlock(type="text", text=m.content)] if isinstance(m.content, str)
                      else m.content)
            if not blocks:
                raise RequestError(f"messages.{i}.content: a message needs at least one block")
            for j, block in enumerate(blocks):
                out.append((m.role, block.checked(f"messages.{i}.content.{j}"),
                            block.cache_control))
        if self.cache_control is not None and out[-1][2] is None:
            role, text, _ = out[-1]
            if not text:
                raise RequestError("cache_control: the last block is empty and cannot be "
                                   "cached")
            out[-1] = (role, text, self.cache_control)
        check_controls([c for _, _, c in out if c is not None])
        return out

    def turns(self) -> list[dict[str, str]]:
        """The chat template's turns: the system's blocks joined, then each message's."""
        turns: list[dict[str, str]] = []
        for role, text, _ in self.pieces():
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"] += text
            else:
                turns.append({"role": role, "content": text})
        return turns

    def breakpoint_ttls(self) -> list[str]:
        """The `ttl` of each cache breakpoint, in prompt order."""
        return [c.ttl for _, _, c in self.pieces() if c is not None]

    def hints(self, tenant: str, breakpoint_tokens: list[int]) -> KvHints:
        """Each breakpoint's prefix retained for its ttl, for `tenant`; no cache_control
        asks nothing of the tier."""
        prefixes = tuple(PrefixRetention(n, CACHE_TTL_S[ttl])
                         for ttl, n in zip(self.breakpoint_ttls(), breakpoint_tokens))
        return KvHints(tenant, prefixes=prefixes)

    def sampling(self) -> SamplingParams:
        """SamplingParams, or a RequestError naming the bad field."""
        refuse_unsupported(self.model_extra, UNSUPPORTED)
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k,
                              stop=list(self.stop_sequences or []))
