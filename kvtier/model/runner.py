"""Drives the decoder for one engine step: owns the device, the KV memory and the sampler."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from kvtier.config import EngineConfig
from kvtier.errors import ConfigError
from kvtier.model.attention import AttentionMetadata, build_metadata
from kvtier.model.layers import Linear, RMSNorm
from kvtier.model.llama import build_model
from kvtier.model.loader import LoadedModel
from kvtier.model.sampler import Sampler, SampleResult
from kvtier.sequence import Sequence

GiB = 1 << 30


class ScheduledChunk(Protocol):
    """What the runner needs of a scheduled sequence (the scheduler's `ScheduledSeq`)."""

    @property
    def seq(self) -> Sequence: ...
    @property
    def start(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def samples(self) -> bool: ...


def mkldnn_usable() -> bool:
    """oneDNN is compiled into torch's CPU builds; some custom builds lack it."""
    return bool(torch.backends.mkldnn.is_available())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class ModelRunner:
    """Builds the model and the paged KV memory, and turns scheduled chunks into sampled tokens."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.spec = loaded.spec
        self.block_size = config.cache.block_size
        model = build_model(loaded.spec)
        model.load_weights(loaded.weights)
        # The rope tables stay float32 (a bf16 table loses positions); the rest takes `dtype`.
        self.model = model.to(device=self.device).eval()
        for child in self.model.children():
            if child is not self.model.rope:
                child.to(dtype=self.dtype)
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant:
            if self.device.type != "cpu":
                raise ConfigError(
                    "batch_invariant=True is implemented for the CPU kernels only; "
                    "use device='cpu' or turn it off"
                )
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.min_rows = 2
        if self.device.type == "cpu" and self.dtype == torch.float32 and mkldnn_usable():
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.pack()
        spec = loaded.spec
        self.block_bytes = (
            spec.num_hidden_layers
            * 2
            * self.block_size
            * spec.num_key_value_heads
            * spec.head_dim
            * self.dtype.itemsize
        )
        num_blocks = config.cache.num_device_blocks
        if num_blocks is None:
            num_blocks = int(config.cache.kv_cache_size * GiB // self.block_bytes)
            if num_blocks < 1:
                raise ConfigError(
                    f"kv_cache_size={config.cache.kv_cache_size} GiB holds no block of "
                    f"{self.block_bytes} bytes; raise it"
                )
        self.num_blocks = num_blocks
        # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]
        self.kv = torch.zeros(
            num_blocks,
            spec.num_hidden_layers,
            self.block_size,
            2,
            spec.num_key_value_heads,
            spec.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler = Sampler(config.seed, self.device)

    @property
    def weight_bytes_per_step(self) -> int:
        """Weight bytes a decode step must read: every matmul weight and norm, plus one row of
        the embedding table per token. Batch-1 decode is bound by streaming these."""
        linear = sum(m.weight_bytes() for m in self.model.modules() if isinstance(m, Linear))
        norms = sum(m.weight.numel() * m.weight.element_size()
                    for m in self.model.modules() if isinstance(m, RMSNorm))
        embed = self.model.embed_tokens.weight
        return linear + norms + embed.shape[1] * embed.element_size()

    @torch.inference_mode()
    def execute(
        self, chunks: Seq[ScheduledChunk], layer_barrier: Callable[[int], None] | None = None
    ) -> dict[str, SampleResult]:
        """Run one step; returns the sampled token of every chunk that ends its known tokens.
        `layer_barrier(l)` is called before layer l touches the KV (layerwise loads)."""
        input_ids, positions, meta, logit_rows, samplers = self._prepare(chunks)
        meta.layer_barrier = layer_barrier
        logits = self.model(input_ids, positions, self.kv, meta, logit_rows)
        results = self.sampler.sample(
            logits, [c.seq.request_id for c in samplers], [c.seq.params for c in samplers]
        )
        return {c.seq.request_id: r for c, r in zip(samplers, results)}

    def _prepare(self, chunks: Seq[ScheduledChunk]) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[ScheduledChunk]
    ]:
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        samplers: list[ScheduledChunk] = []
        for c in chunks:
            start, n = c.start, c.num_new_tokens
            ids.extend(c.seq.tokens(start, start + n))
            pos.extend(range(start, start + n))
            if c.samples:
                logit_rows.append(len(ids) - 1)
                samplers.append(c)
        meta = build_metadata(
            [(c.start, c.num_new_tokens, c.block_ids) for c in chunks], self.block_size, dev,
            invariant=self.batch_invariant,
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
            samplers,
        )
