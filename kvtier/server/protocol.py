"""OpenAI request schemas (plus vLLM's `top_k` and `cache_salt`) and OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.errors import RequestError
from kvtier.sequence import SamplingParams

MAX_TOKENS_DEFAULT = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extra
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None  # vLLM's extra: a per-request prefix-cache namespace
    ignore_eos: bool = False  # vLLM's extra: generate exactly max_tokens
    return_token_ids: bool = False  # vLLM's extra: the generated ids in the final choice

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """SamplingParams, or a RequestError naming the bad field."""
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported; kvtier returns one choice (n=1)")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=MAX_TOKENS_DEFAULT if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content):
            raise RequestError("only text content parts are supported")
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
