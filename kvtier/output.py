"""What a finished request returns, and the stop checks that decide when it is finished."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.model.tokenizer import Tokenizer
from kvtier.sequence import SPLIT_PARTS, Phase, Sequence
from kvtier.tier import HintReply, Residency


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds (TTFT from arrival; decode from first token to finish).

    The TTFT splits into queue_s + tier_s + compute_s (each None before the first token):
    waiting to be admitted (device blocks included), waiting for prior state (a fetch below
    host, a host restore, or the prefill that rebuilds it), and computing the new tokens.
    """

    ttft_s: float | None
    decode_s: float | None
    queue_s: float | None
    num_preemptions: int
    restore_s: float = 0.0  # wall time of this request's host -> device loads
    tier_s: float | None = None
    compute_s: float | None = None

    def parts(self) -> dict[str, float | None]:
        """The TTFT split by part name (SPLIT_PARTS: queue, tier, compute)."""
        return dict(zip(SPLIT_PARTS, (self.queue_s, self.tier_s, self.compute_s), strict=True))


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's shape: `out.outputs[0].text`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int  # prompt tokens found on the device (prefix cache)
    logprobs: list[dict[int, float]] | None
    metrics: RequestMetrics
    finished: bool = True
    # where the prior state lived: resident | host | disk | remote | recomputed | new
    residency: Residency = Residency.NEW
    num_restored_tokens: int = 0  # loaded from the host tier (fetched up to it first if deeper)
    num_swapped_in_tokens: int = 0  # restored after preemptions (not counted above)
    num_recomputed_tokens: int = 0  # state that existed but was computed again
    num_cache_write_tokens: int = 0  # prompt tokens it computed into the prefix cache
    exact_breakpoints: tuple[int, ...] = ()  # breakpoints kept to the token (a block's part)
    restore_bytes: int = 0
    lossy: bool = False  # restored from 8-bit blocks below host (kv_offload_dtype)
    error: str | None = None  # finish_reason "error": why serving this request failed
    # what each hint it asked got (retention, breakpoints, an expected return)
    hint_reply: HintReply = field(default_factory=HintReply)

    @property
    def num_read_tokens(self) -> int:
        """Prompt tokens it did not compute: found on the device or restored from a tier
        (what OpenAI's `cached_tokens` and Anthropic's `cache_read_input_tokens` count)."""
        return self.num_cached_tokens + self.num_restored_tokens

    @property
    def retention(self) -> float | str | None:
        """The retention it asked for: seconds granted, "refused:<reason>", or None."""
        grant = self.hint_reply.retention
        return None if grant is None else grant.value

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [
            CompletionOutput(
                0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs
            )
        ]

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        t = seq.timings
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            metrics=RequestMetrics(t.ttft_s, t.decode_s, t.part_s(Phase.QUEUE),
                                   seq.num_preemptions, seq.restore_s, t.part_s(Phase.TIER),
                                   t.part_s(Phase.COMPUTE)),
            finished=seq.is_finished, residency=seq.residency,
            num_restored_tokens=seq.num_restored_tokens,
            num_swapped_in_tokens=seq.num_swapped_in_tokens,
            num_recomputed_tokens=seq.num_recomputed_tokens,
            num_cache_write_tokens=seq.num_cache_write_tokens,
            exact_breakpoints=seq.exact_breakpoints, restore_bytes=seq.restore_bytes,
            lossy=seq.lossy, hint_reply=seq.hint_reply,
        )


@dataclass(frozen=True)
class StreamDelta:
    """A streaming request after one more token: its text so far and where its state lived
    (known from admission on, so a server can send it before the first token)."""

    request_id: str
    text: str
    num_tokens: int
    finished: bool
    residency: Residency
    holdback: int  # trailing characters that may still turn out to begin a stop string
    lossy: bool = False  # restored from 8-bit blocks below host (kv_offload_dtype)
    num_read_tokens: int = 0  # prompt tokens found on the device or restored, at admission

    @classmethod
    def of(cls, seq: Sequence, finished: bool) -> StreamDelta:
        hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
        if not finished:  # a multi-byte character still being assembled decodes as U+FFFD
            hold = max(hold, len(seq.output_text) - len(seq.output_text.rstrip("\ufffd")))
        return cls(seq.request_id, seq.output_text, len(seq.output_token_ids), finished,
                   seq.residency, hold, seq.lossy,
                   seq.num_cached_tokens + seq.num_restored_tokens)


class StopChecker:
    """Detokenizes a sequence's output and decides whether its last token ends it."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> bool:
        """Update `seq.output_text`; set finish_reason and return True if the request is done."""
        p = seq.params
        token = seq.output_token_ids[-1]
        previous = len(seq.output_text)
        seq.output_text = self.tokenizer.decode(seq.output_token_ids, p.skip_special_tokens)
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            return self._finish(seq, "stop", None)
        if token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        if p.stop:
            # A stop string can straddle tokens: search from just before the new text.
            longest = max(len(s) for s in p.stop)
            begin = max(0, previous - longest + 1)
            for stop in p.stop:
                at = seq.output_text.find(stop, begin)
                if at >= 0:
                    end = at + len(stop) if p.include_stop_str_in_output else at
                    seq.output_text = seq.output_text[:end]
                    return self._finish(seq, "stop", stop)
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length", None)
        return False

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason: int | str | None) -> bool:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        return True
