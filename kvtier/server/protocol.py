"""OpenAI request schemas (plus vLLM's `top_k` and `cache_salt`) and OpenAI-shaped errors.

Strict, as OpenAI's and vLLM's servers are: no string or boolean coerced to a number, no
non-finite float, and a parameter kvtier does not implement is refused by name rather than
silently ignored (an unknown one is ignored, as vLLM does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.errors import RequestError
from kvtier.sequence import MAX_LOGPROBS, SamplingParams
from kvtier.tier import MAX_PREFIXES, KvHints, PrefixRetention

MAX_TOKENS_DEFAULT = 256
DAY_S = 86400.0  # OpenAI's "24h" prompt_cache_retention
# OpenAI's cache lifetimes (`prompt_cache_options.ttl`, a breakpoint's `ttl`): each is a
# retention of that long in every tier that holds the blocks
TTL_S = {"30m": 1800.0, "12h": 43200.0}
DEFAULT_TTL = "30m"
MAX_CACHE_SALT_CHARS = 256
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
# Parameters of OpenAI's or vLLM's API that kvtier does not implement, with the value that
# means "off": any other value is refused (400) by name.
UNSUPPORTED: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
    "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "response_format": {"type": "text"}, "best_of": 1, "echo": False, "suffix": None,
    "min_tokens": 0, "prompt_logprobs": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "min_p": 0, "use_beam_search": False,
}


def refuse_unsupported(extra: Mapping[str, Any] | None, unsupported: Mapping[str, Any],
                       advice: str | None = None) -> None:
    """RequestError naming every parameter of `unsupported` a request sent with a value
    other than the one that means "off" (`advice`: what to do instead; by default, remove
    them)."""
    sent = extra or {}
    refused = sorted(k for k, off in unsupported.items()
                     if k in sent and sent[k] not in (None, off))
    if refused:
        them = "it" if len(refused) == 1 else "them"
        raise RequestError(f"{', '.join(refused)}: not supported by kvtier; "
                           f"{advice or f'remove {them} from the request'}")


class PromptCacheOptions(BaseModel):
    """OpenAI's `prompt_cache_options`: `implicit` (the default) caches the whole prompt for
    `ttl` besides any explicit breakpoint; `explicit` only the breakpoints."""

    model_config = ConfigDict(strict=True, extra="forbid")

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's `prompt_cache_breakpoint` on a content part: the prompt up to the end of
    that part is kept at least `ttl` (the request's when unset)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What every OpenAI generation request carries: sampling, caching, the engine's
    extras."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extra
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's extra
    ignore_eos: bool = False  # vLLM's extra: generate exactly max_tokens
    return_token_ids: bool = False  # vLLM's extra: the generated ids in the final choice
    # OpenAI's prompt caching: who the cache is for (a routing hint: one engine here, so it
    # names no namespace and no tenant, which a client could mint per request to stay under
    # its quota, tenant_source.py) and how long to keep it ("in_memory": as the tier sees
    # fit; "24h": retained a day)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # deprecated by OpenAI
    prompt_cache_options: PromptCacheOptions | None = None
    kv_retention_s: float | None = Field(None, gt=0)  # kvtier's: retain for N seconds
    kv_expect_return_s: float | None = Field(None, gt=0)  # the session is back in N seconds

    def hints(self, tenant: str, breakpoint_tokens: list[int] | None = None) -> KvHints:
        """What the request asks of its KV, for `tenant` (whose quotas and counters it
        counts against: its API key's or router header's, else as `kv_tenant_from` says);
        `breakpoint_tokens`: where each of its cache breakpoints ends in the prompt."""
        options = self.prompt_cache_options
        if self.kv_retention_s is not None and self.prompt_cache_retention == "24h":
            raise RequestError("give one of kv_retention_s and prompt_cache_retention")
        if options is not None and options.ttl is not None and \
                self.prompt_cache_retention is not None:
            raise RequestError("prompt_cache_retention is deprecated and cannot be sent with "
                               "prompt_cache_options.ttl; send prompt_cache_options.ttl alone")
        retention = self.kv_retention_s if self.prompt_cache_retention != "24h" else DAY_S
        ttl = TTL_S[options.ttl or DEFAULT_TTL] if options is not None else TTL_S[DEFAULT_TTL]
        if options is not None and options.mode == "implicit" and retention is None:
            retention = ttl  # the implicit breakpoint: the whole prompt
        marks = self.breakpoints()
        prefixes = tuple(PrefixRetention(n, TTL_S[m.ttl] if m.ttl else ttl)
                         for m, n in zip(marks, breakpoint_tokens or []))
        return KvHints(tenant, retention, self.kv_expect_return_s, prefixes=prefixes)

    def breakpoints(self) -> list[PromptCacheBreakpoint]:
        """The request's cache breakpoints in prompt order (a chat's content parts carry
        them); RequestError past MAX_PREFIXES."""
        return []

    def cache_marks(self, breakpoint_tokens: list[int] | None, prompt_tokens: int
                    ) -> list[tuple[int, str]]:
        """Where the request writes the cache, in prompt order: each breakpoint's tokens and
        ttl label, then (in implicit mode, the default) the whole prompt's."""
        options = self.prompt_cache_options
        ttl = options.ttl if options is not None and options.ttl else DEFAULT_TTL
        marks = [(n, m.ttl or ttl) for m, n in zip(self.breakpoints(), breakpoint_tokens or [])]
        if options is None or options.mode == "implicit":
            marks.append((prompt_tokens, ttl))
        return marks

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """SamplingParams, or a RequestError naming the bad field."""
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported; kvtier returns one choice (n=1)")
        refuse_unsupported(self.model_extra, UNSUPPORTED)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        k = self.top_logprobs_k()
        if k is not None and self.stream:
            raise RequestError("logprobs with stream=true is not supported yet; ask without "
                               "stream to get them")
        return SamplingParams(
            max_tokens=MAX_TOKENS_DEFAULT if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, ignore_eos=self.ignore_eos, logprobs=k,
        )

    def top_logprobs_k(self) -> int | None:
        """How many alternatives to return per generated token (None: no logprobs)."""
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # OpenAI: top-k per token

    def top_logprobs_k(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: str | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # None: an assistant turn that only called tools, as OpenAI accepts
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise RequestError(f"a {self.role} message needs content")
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" or p.text is None for p in self.content):
            raise RequestError("only text content parts ({\"type\": \"text\", \"text\": "
                               "...}) are supported")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def breakpoints(self) -> list[PromptCacheBreakpoint]:
        return message_breakpoints(self.messages)

    def pieces(self) -> list[tuple[str, bool]]:
        return message_pieces(self.messages)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def message_breakpoints(messages: list[ChatMessage]) -> list[PromptCacheBreakpoint]:
    """The cache breakpoints the messages' content parts carry, in prompt order;
    RequestError past MAX_PREFIXES."""
    marks = [p.prompt_cache_breakpoint for m in messages if isinstance(m.content, list)
             for p in m.content if p.prompt_cache_breakpoint is not None]
    check_breakpoints(len(marks))
    return marks


def check_breakpoints(count: int) -> None:
    """RequestError for more breakpoints than a request writes (MAX_PREFIXES)."""
    if count > MAX_PREFIXES:
        raise RequestError(f"{count} content parts carry prompt_cache_breakpoint; a "
                           f"request writes at most {MAX_PREFIXES}")


def message_pieces(messages: list[ChatMessage]) -> list[tuple[str, bool]]:
    """Each message's text in order, a content part's own, and whether it carries a cache
    breakpoint (`prompt_cache.breakpoint_tokens` finds where each ends)."""
    out: list[tuple[str, bool]] = []
    for m in messages:
        if isinstance(m.content, list):
            out.extend((p.text or "", p.prompt_cache_breakpoint is not None)
                       for p in m.content)
        elif m.content:
            out.append((m.content, False))
    return out


class KvPromptRequest(BaseModel):
    """The prompt (or chat messages) a KV route acts on: one a request will send soon
    (POST /v1/kv/prefetch), one whose blocks go (DELETE /v1/kv)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)

    def check(self) -> None:
        """One of prompt and messages (RequestError otherwise)."""
        check_one_prompt(self.prompt, self.messages)


def check_one_prompt(prompt: Any, messages: Any) -> None:
    """A KV route's body names its prompt once: RequestError otherwise (`kvtier serve`, and
    `vllm serve`'s middleware)."""
    if (prompt is None) == (messages is None):
        raise RequestError("name the prompt as exactly one of 'prompt' (text or token ids) "
                           "and 'messages'")


class KvPurgeRequest(KvPromptRequest):
    """What DELETE /v1/kv erases: a prompt's blocks (`scope` "prompt", named as the other KV
    routes name one), or every block of the caller's tenant (`scope` "tenant", no prompt)."""

    scope: Literal["prompt", "tenant"] = "prompt"

    def check(self) -> None:
        if self.scope == "tenant":
            if self.prompt is not None or self.messages is not None:
                raise RequestError("a purge of scope 'tenant' erases every block of the "
                                   "caller's tenant; name no prompt or messages with it")
            return
        super().check()


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The namespace salt of a tenant's request: its own blocks, and its cache_salt's."""
    return f"tenant={tenant}|salt={cache_salt or ''}"


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
