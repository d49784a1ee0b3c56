"""The LLM facade in vLLM's shape: `LLM(model=..., **knobs).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine, PromptType
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.errors import RequestError
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams

Message = dict[str, Any]


class LLM:
    """Offline inference: load a model once, then generate or chat in batches."""

    def __init__(self, model: str | None = None, **knobs: Any) -> None:
        self.config = EngineConfig.from_knobs(model=model, **knobs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.log = RequestLog()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str = "",
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched together); outputs keep the input order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if not prompts:
            raise RequestError("generate() got no prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; pass one "
                    "or one per prompt"
                )
        ids = [
            self.engine.add_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, params)
        ]
        try:
            done = self.engine.run_to_completion(ids)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        outputs = [done[rid] for rid in ids]
        self.log.add(outputs)
        return outputs

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str = "",
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or several, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)  # type: ignore[arg-type]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)

    def stats(self) -> dict[str, Any]:
        """TTFT percentiles split by residency class, the tier's traffic and occupancy,
        swap vs recompute counts, failed transfers and the planner's error."""
        return engine_stats(self.engine, self.log)

    def shutdown(self) -> None:
        """Stop background transfer work (pending transfers fail and count as misses)."""
        self.engine.close()
