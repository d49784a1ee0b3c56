"""Per-request state and sampling parameters: pure bookkeeping, no tensors."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from kvtier.errors import RequestError
from kvtier.tier import HintReply, Residency
from kvtier.tier import KvHints as KvHints  # re-exported: its home was here

SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's threshold)
MAX_TEMPERATURE = 100.0  # beyond it every token is equally likely: a caller's mistake
SEED_MAX = 2**63 - 1  # what a torch.Generator takes
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool, not NaN, not an infinity)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the fields and defaults follow vLLM's."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities of each generated token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """vLLM's rule: a temperature below SAMPLING_EPS picks the most likely token (dividing
        the logits by it would overflow to inf and the probabilities to NaN)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature={self.temperature!r} must be a number in "
                               f"[0, {MAX_TEMPERATURE:g}]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k={self.top_k!r} must be -1, 0 (off) or a positive integer")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise RequestError(f"seed={self.seed!r} must be an integer in [0, 2**63 - 1]")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs={self.logprobs!r} must be an integer between 0 and "
                               f"{MAX_LOGPROBS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop={self.stop!r} must be a list of non-empty strings")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    """Where a request's time to first token goes: waiting to be admitted (queue), waiting for
    its prior state (tier: a fetch, a restore, or the prefill that recomputes it), or
    computing its new tokens (compute)."""

    QUEUE = "queue"
    TIER = "tier"
    COMPUTE = "compute"


SPLIT_PARTS = tuple(p.value for p in Phase)  # queue, tier, compute: they add up to the TTFT


@dataclass
class RequestTimings:
    """Wall-clock instants of a request's life, and a ledger that charges every interval from
    arrival to first token to one Phase, so the parts add up to the TTFT by construction."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    phase: Phase = Phase.QUEUE  # what the request is doing now (until its first token)
    # Prompt tokens that only rebuild state the request already had (declined restores,
    # failed loads, a recompute preemption): computing them is tier time, not compute.
    state_tokens: int = 0
    split: dict[Phase, float] = field(default_factory=lambda: dict.fromkeys(Phase, 0.0))
    _mark: float = field(default=-1.0, repr=False)

    def __post_init__(self) -> None:
        if self._mark < 0:
            self._mark = self.arrival

    def enter(self, phase: Phase, now: float) -> None:
        """Charge the time since the last mark to the current phase, then switch to `phase`."""
        if self.first_token is not None:
            return
        self.split[self.phase] += max(0.0, now - self._mark)
        self._mark = max(self._mark, now)
        self.phase = phase

    def step(self, start: float, end: float, tier_s: float, ready: bool) -> None:
        """One engine step that computed part of this request's prompt: `tier_s` of it went
        to its prior state (a recompute's share, a layerwise load's stall), the rest to compute.
        Not `ready`: the step only rebuilt prior state, so all of it is tier time."""
        if self.first_token is not None:
            return
        self.enter(self.phase, start)  # the gap before the step, in whatever it waited in
        duration = max(0.0, end - self._mark)
        tier_s = duration if not ready else min(max(tier_s, 0.0), duration)
        self.split[Phase.TIER] += tier_s
        self.split[Phase.COMPUTE] += duration - tier_s
        self._mark = max(self._mark, end)
        self.phase = Phase.COMPUTE if ready else Phase.TIER

    def first(self, now: float) -> None:
        """The first token: close the ledger."""
        self.enter(self.phase, now)
        self.first_token = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def part_s(self, phase: Phase) -> float | None:
        """Seconds of the TTFT spent in `phase`; None before the first token."""
        return None if self.first_token is None else self.split[phase]

    @property
    def decode_s(self) -> float | None:
        if self.first_token is None or self.finished is None:
            return None
        return self.finished - self.first_token


@dataclass
class SwapState:
    """Where a swapped-out sequence's KV went: one key per block (content keys for full
    blocks, a per-request key for the partial last one) and how many tokens they cover."""

    keys: list[bytes]
    tokens: list[list[int]]
    num_computed: int


RESIDENCY_CLASSES = (Residency.RESIDENT, Residency.HOST, Residency.DISK, Residency.SHARED,
                     Residency.RECOMPUTED, Residency.NEW)  # the order reports list them in


@dataclass
class Sequence:
    """One request: its tokens and how many of them already have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the device cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Where this request's prior state lived when it was first admitted (RESIDENCY_CLASSES):
    # resident (device prefix hit), host (restored), disk / remote (restored after a fetch up
    # from that tier), recomputed (it existed but was computed again), new. TTFT is reported
    # per class because the classes differ by 10x.
    residency: Residency = Residency.NEW
    num_restored_tokens: int = 0  # prompt tokens restored at admission (<= the prompt)
    num_swapped_in_tokens: int = 0  # its own state restored after each preemption
    num_recomputed_tokens: int = 0
    # prompt tokens of full blocks it computed and published in the prefix cache (beyond
    # what it read): what usage reports as written to the cache
    num_cache_write_tokens: int = 0
    # cache breakpoints inside a block whose part of that block went down to host: kept to
    # the token, where the rest are kept to the last full block before them
    exact_breakpoints: tuple[int, ...] = ()
    restore_bytes: int = 0
    restore_s: float = 0.0
    loading: int | None = None  # tier job id of the host->device load this sequence waits for
    swapped: SwapState | None = None
    lossy: bool = False  # restored from 8-bit blocks (kv_offload_dtype): not bit-exact
    hints: KvHints = field(default_factory=KvHints)
    # what each hint asked in `hints` got, set at finish
    hint_reply: HintReply = field(default_factory=HintReply)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
