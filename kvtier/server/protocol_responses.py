"""OpenAI's Responses request (`POST /v1/responses`) as kvtier takes it: `instructions` and
text `input` (a string, or messages of `input_text` / `output_text` parts, each of which may
carry a `prompt_cache_breakpoint`), the caching fields chat takes, and `prewarm`: fill the
cache, generate nothing. What needs state kvtier does not keep (`previous_response_id`,
`conversation`) or tools is refused by name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kvtier.errors import RequestError
from kvtier.server.protocol import (
    ChatMessage,
    GenerationRequest,
    PromptCacheBreakpoint,
    PromptCacheOptions,
    message_breakpoints,
    message_pieces,
    refuse_unsupported,
)

TEXT_PARTS = ("input_text", "output_text")  # what a message's content parts may be
# what the Responses API has that kvtier does not implement, with the value that means "off"
UNSUPPORTED: dict[str, Any] = {"previous_response_id": None, "conversation": None,
                               "background": False, "include": [], "reasoning": None,
                               "max_tool_calls": None, "prompt": None}


class ResponsesCacheOptions(PromptCacheOptions):
    """`prompt_cache_options` with the Responses API's `prewarm`."""

    prewarm: bool = False


class InputMessage(ChatMessage):
    """A message of `input`: text or `input_text` / `output_text` parts."""

    type: Literal["message"] = "message"

    @model_validator(mode="before")
    @classmethod
    def _a_message(cls, item: Any) -> Any:
        """An item of another type (a tool call's output, reasoning) is refused by name."""
        kind = item.get("type", "message") if isinstance(item, dict) else "message"
        if kind != "message":
            raise ValueError(f"a {kind!r} item is not supported; kvtier takes messages of "
                             "text")
        return item

    def text(self) -> str:
        if isinstance(self.content, list) and any(p.type not in TEXT_PARTS or p.text is None
                                                  for p in self.content):
            kinds = sorted({p.type for p in self.content if p.type not in TEXT_PARTS})
            raise RequestError(f"{', '.join(kinds) or 'a part without text'}: only "
                               "input_text and output_text parts are supported")
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return super().text()


class ResponsesRequest(GenerationRequest):
    """The body of `POST /v1/responses`."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    store: bool | None = None  # nothing is stored either way (see `stored`)
    prompt_cache_options: ResponsesCacheOptions | None = None

    def messages(self) -> list[ChatMessage]:
        """The chat template's messages: the instructions as the system's, then the input."""
        head = [ChatMessage(role="system", content=self.instructions)] if self.instructions \
            else []
        if isinstance(self.input, str):
            return [*head, ChatMessage(role="user", content=self.input)]
        return [*head, *self.input]

    def pieces(self) -> list[tuple[str, bool]]:
        return message_pieces(self.messages())

    def breakpoints(self) -> list[PromptCacheBreakpoint]:
        return message_breakpoints(self.messages())

    def echo(self) -> dict[str, Any]:
        """What a response object repeats of its request."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p,
                "prompt_cache_key": self.prompt_cache_key, "metadata": {}}

    @property
    def prewarm(self) -> bool:
        return bool(self.prompt_cache_options and self.prompt_cache_options.prewarm)

    def checked(self) -> None:
        """RequestError for what kvtier refuses by name."""
        refuse_unsupported(self.model_extra, UNSUPPORTED, "it keeps no responses: send the "
                           "whole conversation as input")
        for m in self.messages():
            m.text()
