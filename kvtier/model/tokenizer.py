"""Text <-> token ids and chat templates, wrapping a `tokenizers.Tokenizer` built by a loader."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtier.errors import RequestError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@dataclass
class Tokenizer:
    """A backend tokenizer plus the special ids and chat template that came with the model."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    add_bos_token: bool = False
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>"}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        wants_bos = add_special_tokens and self.add_bos_token and bos is not None
        if wants_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render messages with the model's own Jinja template (sandboxed, as transformers does)."""
        if not messages:
            raise RequestError("messages is empty; send at least one {'role', 'content'} message")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if not self.chat_template:
            # No template shipped: a plain transcript keeps chat usable on base models.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as e:
            raise RequestError(f"the model's chat template rejected the messages: {e}") from e

    def digest(self) -> str:
        """Content digest of the full tokenizer definition, for the cache fingerprint."""
        return hashlib.blake2b(self.backend.to_str().encode(), digest_size=16).hexdigest()


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 stays, the rest move past 255."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in kept}
    moved = [b for b in range(256) if b not in alphabet]
    alphabet.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return alphabet
