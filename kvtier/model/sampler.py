"""Next-token choice from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.sequence import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # top-k log-probabilities plus the chosen token's
    error: str | None = None  # this request could not be sampled (token_id is then -1)


class Sampler:
    """Samples each row with its own parameters; a seeded request gets its own generator,
    so its tokens do not depend on what else is in the batch."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self.request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self.request_generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[SampleResult]:
        # logits: [S, vocab] float32
        greedy_ids = logits.argmax(dim=-1).tolist()
        results = []
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            try:  # one request's failure is its own: the others in the batch still sample
                token = (greedy_ids[i] if p.greedy
                         else self._draw(logits[i], self._generator(rid, p), p))
                results.append(SampleResult(token, self._logprobs(logits[i], token, p.logprobs)))
            except (RuntimeError, ValueError, OverflowError) as e:
                results.append(SampleResult(-1, None, f"sampling failed: {e}"))
        return results

    @staticmethod
    def _draw(row: torch.Tensor, gen: torch.Generator, p: SamplingParams) -> int:
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()):  # non-finite logits: never sample from NaN
            raise ValueError("the model produced non-finite logits for this request")
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
        if k is None:
            return None
        lp = torch.log_softmax(row, dim=-1)
        top = torch.topk(lp, k) if k > 0 else None
        out = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
        out[token] = float(lp[token])
        return out
