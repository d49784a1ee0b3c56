"""LLMEngine: one `step()` = schedule -> run the model -> postprocess.

Requests enter with `add_request`, leave as `RequestOutput`s from `step()` when finished.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

from kvtier.cache.block import BlockKey
from kvtier.cache.block_pool import BlockPool
from kvtier.cache.fingerprint import Fingerprint
from kvtier.config import EngineConfig
from kvtier.errors import RequestError
from kvtier.model.loader import LoadedModel, load_model
from kvtier.model.runner import ModelRunner
from kvtier.model.sampler import SampleResult
from kvtier.output import RequestOutput, StopChecker
from kvtier.scheduler import Scheduler, SchedulerOutput
from kvtier.sequence import SamplingParams, Sequence

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        loaded = loaded if loaded is not None else load_model(config.model)
        self.model_source = loaded.source
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(loaded, config)
        bs = config.cache.block_size
        self.fingerprint = Fingerprint(
            weights_digest=loaded.weights_digest,
            architecture=loaded.spec.describe(),
            kv_dtype=str(self.runner.dtype).removeprefix("torch."),
            block_size=bs,
            tokenizer_digest=self.tokenizer.digest(),
            attention_backend=f"torch-sdpa-{self.runner.device.type}"
            + ("-invariant" if config.batch_invariant else ""),
        )
        self.pool = BlockPool(self.runner.num_blocks, config.cache.enable_prefix_caching)
        context = config.scheduler.max_model_len or loaded.spec.max_position_embeddings
        self.max_model_len = min(context, self.runner.num_blocks * bs)
        self.scheduler = Scheduler(
            config.scheduler, self.pool, bs, max_model_len=self.max_model_len
        )
        self.stops = StopChecker(self.tokenizer, self.max_model_len)
        self._namespaces: dict[str, BlockKey] = {}
        self._ids = itertools.count()
        self.finished_outputs: list[RequestOutput] = []

    def namespace(self, salt: str = "") -> BlockKey:
        if salt not in self._namespaces:
            self._namespaces[salt] = self.fingerprint.namespace(salt)
        return self._namespaces[salt]

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> str:
        """Validate and queue one request; returns its id."""
        params = params if params is not None else SamplingParams()
        params.validate()
        text, token_ids = self._tokenize(prompt)
        if not token_ids or text == "":
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt_token_ids contains {bad[0]}, outside the vocabulary 0..{vocab - 1}"
            )
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}"
                " (the model's context, capped by the device pool); shorten the prompt"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, token_ids, params, cache_salt=cache_salt, prompt=text)
        self.scheduler.add(seq, self.namespace(cache_salt))
        return rid

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise RequestError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"unsupported prompt type {type(prompt).__name__}; use str or token ids")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.runner.execute(batch.scheduled)
        return self._postprocess(batch, sampled)

    def _postprocess(
        self, batch: SchedulerOutput, sampled: dict[str, SampleResult]
    ) -> list[RequestOutput]:
        self.scheduler.update(batch, {rid: r.token_id for rid, r in sampled.items()})
        now = time.perf_counter()
        done: list[Sequence] = []
        for s in batch.scheduled:
            result = sampled.get(s.seq.request_id)
            if result is None:
                continue
            seq = s.seq
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs)
            if self.stops.check(seq):
                seq.timings.finished = now
                done.append(seq)
        self.scheduler.finish(done)
        for seq in done:
            self.runner.sampler.forget(seq.request_id)
        return [RequestOutput.of(seq) for seq in done]

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        seq.timings.finished = time.perf_counter()
        self.runner.sampler.forget(request_id)
        return RequestOutput.of(seq)

    def run_to_completion(self, request_ids: Seq[str]) -> dict[str, RequestOutput]:
        """Step until every listed request has finished; other requests progress too."""
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        idle_steps = 0
        while wanted - done.keys():
            outputs = self.step()
            idle_steps = 0 if outputs or self.scheduler.running else idle_steps + 1
            assert idle_steps < 3, "scheduler made no progress"
            for out in outputs:
                if out.request_id in wanted:
                    done[out.request_id] = out
                else:
                    self.finished_outputs.append(out)
        return done
