"""LLMEngine: one `step()` = reap transfers -> schedule -> submit transfers -> run -> postprocess.

Requests enter with `add_request`, leave as `RequestOutput`s from `step()` when finished.
With `kv_offloading_size > 0` the tier sits under the device pool (`TierClient`); without,
a `NullTier` answers every question, so the loop reads the same either way.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from kvtier.cache.block_pool import BlockPool
from kvtier.config import EngineConfig
from kvtier.engine.batch import SchedulerOutput
from kvtier.engine.engine_tier import EngineTier
from kvtier.engine.faults import EngineFaults
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.tier_client import TierClient
from kvtier.errors import RequestError
from kvtier.model.loaded import LoadedModel
from kvtier.model.loader import load_model
from kvtier.model.runner import ModelRunner
from kvtier.model.sampler import SampleResult
from kvtier.output import RequestOutput, StopChecker, StreamDelta
from kvtier.sequence import Phase, SamplingParams, Sequence
from kvtier.tier import BlockKey, Fingerprint, KvHints, Purged, hash_blocks, partial_keys

PromptType = str | list[int] | dict[str, Any]
NAMESPACE_CACHE = 1024  # distinct cache salts whose chain seed is kept
log = logging.getLogger(__name__)


def _close_at_exit(engine: LLMEngine) -> None:
    """Close `engine` at interpreter exit if it is still alive then (a weak reference: the
    hook never keeps an engine, its weights and its pools alive)."""
    ref = weakref.ref(engine)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 faults: EngineFaults | None = None) -> None:
        """`faults`: what a test makes fail (default: what the environment asks, nothing)."""
        config.validate()
        self.config = config
        self.faults = faults or EngineFaults.from_env()
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
            kv_offload_encoding=config.offload.kv_offload_dtype or "",
        )
        self.pool = BlockPool(self.runner.num_blocks, config.cache.enable_prefix_caching)
        context = config.scheduler.max_model_len or loaded.spec.max_position_embeddings
        self.max_model_len = min(context, self.runner.num_blocks * bs)
        self.tier: EngineTier = TierClient.build(
            config, self.runner, self.pool, self.fingerprint.namespace(), self.faults.tier)
        self.scheduler = Scheduler(config.scheduler, self.pool, bs, self.tier,
                                   max_model_len=self.max_model_len)
        self._closed = False
        if self.tier.below_host:  # interpreter exit is a clean shutdown too
            _close_at_exit(self)
        self.stops = StopChecker(self.tokenizer, self.max_model_len)
        self._namespaces: dict[str, BlockKey] = {}
        self._ids = itertools.count()
        self.finished_outputs: list[RequestOutput] = []
        self._streaming: set[str] = set()
        self.stream_deltas: list[StreamDelta] = []
        self.busy_s = 0.0  # wall time of steps that ran a batch: the engine's utilisation

    def namespace(self, salt: str = "") -> BlockKey:
        """The chain seed of `salt` (tenant and cache_salt), from a bounded LRU: one entry per
        distinct salt would otherwise grow with traffic forever."""
        key = self._namespaces.pop(salt, None)
        if key is None:
            key = self.fingerprint.namespace(salt)
            if len(self._namespaces) >= NAMESPACE_CACHE:
                self._namespaces.pop(next(iter(self._namespaces)))
        self._namespaces[salt] = key  # most recently used last
        return key

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        stream: bool = False,
        strict_length: bool = False,
        hints: KvHints | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. With `stream`, every new token
        also lands in `stream_deltas` (drained by the caller, e.g. the server's loop).
        `hints`: its tenant, the retention it asks for, when its session comes back."""
        params = params if params is not None else SamplingParams()
        params.validate()
        hints = hints if hints is not None else KvHints()
        problem = hints.problem()
        if problem is not None:
            raise RequestError(problem)
        text, token_ids = self._checked_prompt(prompt)
        if strict_length and len(token_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens "
                f"exceeds max_model_len={self.max_model_len}; lower max_tokens"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, token_ids, params, cache_salt=cache_salt, prompt=text, hints=hints)
        self.faults.admitted(params)
        self.scheduler.add(seq, self.namespace(cache_salt))
        if stream:
            self._streaming.add(rid)
        return rid

    def prefetch(self, prompt: PromptType, cache_salt: str = "", tenant: str = ""
                 ) -> dict[str, Any]:
        """Bring this prompt's prefix up from the stores below host into host memory now,
        for a request expected soon (a client's hint; nothing is computed), within
        `tenant`'s prefetch budget. What was found: the prompt's full blocks, those already
        on host, those on their way up and from where, and those left below for the budget
        (`limited_blocks`). RequestError for a prompt no request could send."""
        _, token_ids = self._checked_prompt(prompt)
        self.scheduler.apply(self.tier.reap())  # what landed since the last step counts
        bs = self.scheduler.block_size
        keys = hash_blocks(self.namespace(cache_salt), token_ids, bs)
        chunks = [token_ids[i * bs:(i + 1) * bs] for i in range(len(keys))]
        found = self.tier.prefetch(f"prefetch-{next(self._ids)}", keys, chunks, tenant)
        return {"prompt_tokens": len(token_ids), "blocks": len(keys),
                "host_blocks": found.host_blocks, "fetching_blocks": found.fetching_blocks,
                "from": [m.value for m in found.media], "limited_blocks": found.limited}

    def purge(self, prompt: PromptType, cache_salt: str = "") -> dict[str, Any]:
        """Remove this prompt's blocks (in `cache_salt`'s namespace) from every tier: its
        full blocks and every part of a block a cache breakpoint inside it could have kept
        (one key per prompt token in all), the device's free cached copies and the host's
        now, the copies below host erased (a disk slot overwritten, a file or a key deleted)
        before this returns. A device copy a running request uses stays (`device_in_use`:
        ask again when it is done); a copy a job holds goes once the job is done
        (`host_in_use`). RequestError for a prompt no request could send."""
        _, token_ids = self._checked_prompt(prompt)
        bs = self.scheduler.block_size
        namespace = self.namespace(cache_salt)
        keys = hash_blocks(namespace, token_ids, bs)
        parts = [key for i, parent in enumerate([namespace, *keys])
                 for key, _ in partial_keys(parent, token_ids[i * bs:(i + 1) * bs], bs)]
        device = self.pool.purge(keys)  # the device keeps full blocks only
        purged, events = self.tier.purge(keys + parts)
        self.scheduler.apply(events)
        return {"prompt_tokens": len(token_ids), "blocks": len(keys),
                **_purge_counts(device, purged)}

    def purge_tenant(self, tenant: str) -> dict[str, Any]:
        """Remove every block `tenant` owns from every tier, as `purge` removes a prompt's:
        the blocks a tier here holds for it, and those it wrote that only a shared store
        may still hold, as far as the tier remembers their owner (the last 65536 such
        blocks). Blocks a tier never held (a device's under write_back) have no owner."""
        purged, keys, events = self.tier.purge_tenant(tenant)
        device = self.pool.purge(keys)
        self.scheduler.apply(events)
        return {"tenant": tenant, "blocks": len(keys), **_purge_counts(device, purged)}

    def _checked_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, refused (RequestError) where no request could
        send it: empty, outside the vocabulary, or past max_model_len."""
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
        return text, token_ids

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
        tier, scheduler = self.tier, self.scheduler
        self.faults.before_step()
        scheduler.apply(tier.reap())
        tier.stage_returns()  # sessions due back soon (kv_expect_return_s): up to host
        batch = scheduler.schedule()
        tier.submit()
        if not batch:
            scheduler.apply(tier.wait_any())  # blocked on a swap's store or a wake's load
            return []
        start = time.perf_counter()
        self._mark_held_back(batch, start)
        try:
            self.faults.before_forward(s.seq.params for s in batch.scheduled)
            sampled = self.runner.execute(batch.scheduled, tier.layer_barrier(batch))
        except Exception as e:  # the forward pass: no one request to pin it on
            log.exception("kvtier: a forward pass failed; failing the requests of that step")
            scheduler.apply(tier.finish_layerwise(batch))  # loads into their blocks land first
            why = f"the engine failed the step serving this request ({type(e).__name__}: {e})"
            return self._fail({s.seq.request_id: why for s in batch.scheduled})
        void = scheduler.apply(tier.finish_layerwise(batch))  # failed loads void their step
        tier.observe_prefill(batch, time.perf_counter() - start)
        outputs = self._postprocess(batch, sampled, void, start)
        tier.submit()  # write-through of what just finished
        self.busy_s += time.perf_counter() - start
        return outputs

    def _mark_held_back(self, batch: SchedulerOutput, now: float) -> None:
        """Running requests left out of this step (no token budget or device blocks) and not
        waiting on a load are queued, as far as their TTFT is concerned."""
        scheduled = {s.seq.request_id for s in batch.scheduled}
        for seq in self.scheduler.running:
            if seq.request_id not in scheduled and seq.loading is None:
                seq.timings.enter(Phase.QUEUE, now)

    def _charge_step(self, batch: SchedulerOutput, start: float, now: float,
                     void: set[str]) -> None:
        """Split this step's time, per request still before its first token, into tier (its
        share of tokens that rebuild prior state, and any layerwise-load stall) and compute."""
        stalls = self.tier.stalls()
        for s in batch.scheduled:
            t = s.seq.timings
            if s.seq.request_id in void:  # a failed layerwise load: the step was lost to it
                t.step(start, now, 0.0, ready=False)
                continue
            n = s.num_new_tokens
            rebuilt = min(max(t.state_tokens - s.start, 0), n)
            stall = min(stalls.get(s.seq.request_id, 0.0), now - start)
            tier_s = stall + (now - start - stall) * rebuilt / n if n else stall
            t.step(start, now, tier_s, ready=s.start + n >= t.state_tokens)

    def _postprocess(
        self, batch: SchedulerOutput, sampled: dict[str, SampleResult], void: set[str],
        start: float,
    ) -> list[RequestOutput]:
        failed = {rid: str(r.error) for rid, r in sampled.items() if r.error is not None}
        failed |= {s.seq.request_id: "injected: sampling failed" for s in batch.scheduled
                   if s.seq.request_id in sampled and self.faults.failed_sampling(s.seq.params)}
        self.scheduler.update(
            batch, {rid: r.token_id for rid, r in sampled.items() if rid not in void},
            void | failed.keys())
        now = time.perf_counter()
        self._charge_step(batch, start, now, void)
        done: list[Sequence] = []
        for s in batch.scheduled:
            rid = s.seq.request_id
            result = sampled.get(rid)
            if result is None or rid in void or rid in failed:
                continue
            seq = s.seq
            if seq.timings.first_token is None:
                seq.timings.first(now)
            if result.logprobs is not None:
                seq.logprobs.append(result.logprobs)
            try:
                finished = self.stops.check(seq)
            except Exception as e:  # detokenizing or stop checking this one request
                log.exception("kvtier: request %s failed after sampling", rid)
                failed[rid] = f"the engine failed to detokenize its output ({type(e).__name__})"
                continue
            if finished:
                seq.timings.finished = now
                done.append(seq)
            if rid in self._streaming:
                self.stream_deltas.append(StreamDelta.of(seq, finished))
        self.scheduler.finish(done)
        for seq in done:
            self.runner.sampler.forget(seq.request_id)
            self._streaming.discard(seq.request_id)
        return [RequestOutput.of(seq) for seq in done] + self._fail(failed)

    def _fail(self, failures: dict[str, str]) -> list[RequestOutput]:
        """End these requests with finish_reason "error" (blocks freed, full blocks kept);
        the rest of the engine serves on."""
        outputs = []
        for rid, why in failures.items():
            out = self.abort(rid)
            if out is not None:
                log.error("kvtier: request %s failed: %s", rid, why)
                outputs.append(replace(out, finish_reason="error", error=why))
        return outputs

    def demote_cached(self) -> int:
        """Move every cached device block that no request is using down to the host tier now
        and free its device copy; returns how many blocks were demoted."""
        before = self.tier.demoted_blocks
        self.drain()  # blocks still being written through are demoted once they land
        self.tier.demote_all()
        self.drain()
        return self.tier.demoted_blocks - before

    def drain(self) -> None:
        """Wait until the tier has nothing in flight (what a user's think time allows)."""
        self.scheduler.apply(self.tier.drain())

    def close(self) -> None:
        """Write the cache down to the disk tier if there is one (what a restart will find),
        then stop the transfer workers; pending transfers fail (their sequences recompute).
        Runs once: `LLM.shutdown()`, the server's SIGTERM and interpreter exit all land here."""
        if self._closed:
            return
        self._closed = True
        try:
            self.scheduler.apply(self.tier.write_down())
        except Exception:  # a failing disk must not stop the rest of the shutdown
            log.exception("kvtier: writing the KV cache down to disk at shutdown failed")
        finally:
            self.tier.close()

    def abort(self, request_id: str) -> RequestOutput | None:
        self._streaming.discard(request_id)
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
            busy = self.scheduler.running or self.tier.busy
            idle_steps = 0 if outputs or busy else idle_steps + 1
            assert idle_steps < 3, "scheduler made no progress"
            for out in outputs:
                if out.request_id in wanted:
                    done[out.request_id] = out
                else:
                    self.finished_outputs.append(out)
        return done


def _purge_counts(device: tuple[int, int], purged: Purged) -> dict[str, Any]:
    """A purge's answer: what went and what stayed, per tier (JSON for the client)."""
    return {"device_blocks": device[0], "device_in_use": device[1],
            "host_blocks": purged.host_blocks, "host_in_use": purged.host_in_use,
            "erased": {m.value: n for m, n in purged.below.items()},
            "erase_failures": {m.value: n for m, n in purged.erase_failures.items()}}
