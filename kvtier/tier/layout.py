"""KVLayout: an engine's KV memory as the tier sees it, and nothing more of that engine.

Two shapes are known, both with the block as dimension 0:
  from_contiguous(kv)    one tensor, every layer of a block in one run (kvtier's own engine)
                         kv: [num_blocks, num_layers, *layer_block_shape]
  from_layers(layers)    one tensor per layer, as vLLM hands them to a KV connector
                         layer: [num_blocks, *layer_block_shape], e.g. vLLM CPU
                         [num_blocks, num_kv_heads, block_size, 2 * head_size]
                         (`heads_first`: K then V in the last dimension, as there)
A block of one layer is always one contiguous run (`layer_view(l)[b]`), copied as opaque
bytes; the tier never reads single tokens. A host slot holds one block for all layers:
[num_layers, *layer_block_shape]. No torch here: only the tensors' own methods are used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class KVLayout:
    """Which tensors hold the KV blocks, and how many bytes one block of one layer is."""

    tensors: tuple[Any, ...]  # one (contiguous) or one per layer
    contiguous: bool  # True: tensors[0] is [num_blocks, num_layers, ...]
    num_blocks: int
    num_layers: int
    layer_block_shape: tuple[int, ...]
    dtype: Any
    device: Any
    # per layer and block [num_kv_heads, block_size, 2 * head_dim], K then V (vLLM's LBHNC):
    # what lets an 8-bit encoding find heads and tokens in a block it otherwise copies opaque
    heads_first: bool = False

    @classmethod
    def from_contiguous(cls, kv: Any) -> KVLayout:
        """kv: [num_blocks, num_layers, *layer_block_shape], contiguous."""
        if len(kv.shape) < 3 or not kv.is_contiguous():
            raise ConfigError(
                f"a contiguous KV layout needs one contiguous tensor [num_blocks, num_layers, "
                f"...]; got shape {tuple(kv.shape)} (contiguous={kv.is_contiguous()})")
        return cls((kv,), True, int(kv.shape[0]), int(kv.shape[1]),
                   tuple(int(d) for d in kv.shape[2:]), kv.dtype, kv.device)

    @classmethod
    def from_layers(cls, layers: Mapping[str, Any] | Sequence[Any],
                    heads_first: bool = False) -> KVLayout:
        """One tensor per layer, each [num_blocks, ...] and contiguous, all alike. A mapping
        is ordered by the layer index in its names ("model.layers.7.self_attn.attn")."""
        tensors = list(_in_layer_order(layers) if isinstance(layers, Mapping) else layers)
        if not tensors:
            raise ConfigError("from_layers got no KV tensors")
        first = tensors[0]
        for i, t in enumerate(tensors):
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype \
                    or t.device != first.device:
                raise ConfigError(
                    f"KV layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}, layer 0 "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}; every layer must "
                    "be alike (a hybrid model's KV is not supported)")
            if len(t.shape) < 2 or not t.is_contiguous():
                raise ConfigError(
                    f"KV layer {i} of shape {tuple(t.shape)} must be contiguous with the "
                    "block as dimension 0 (a block of a layer is then one run of bytes)")
        shape = tuple(int(d) for d in first.shape[1:])
        if heads_first and (len(shape) != 3 or shape[2] % 2):
            raise ConfigError(f"a heads-first KV layer block is [num_kv_heads, block_size, "
                              f"2 * head_dim]; got {shape}")
        return cls(tuple(tensors), False, int(first.shape[0]), len(tensors), shape,
                   first.dtype, first.device, heads_first)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block across all layers: the shape of a host slot."""
        return (self.num_layers, *self.layer_block_shape)

    @property
    def element_size(self) -> int:
        return int(self.tensors[0].element_size())

    @property
    def layer_block_nbytes(self) -> int:
        """Bytes of one block of one layer."""
        return math.prod(self.layer_block_shape) * self.element_size

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.layer_block_nbytes

    @property
    def is_cuda(self) -> bool:
        return bool(self.tensors[0].is_cuda)

    @property
    def coded_block_shape(self) -> tuple[int, ...] | None:
        """One block as an 8-bit encoding reads it, [num_layers, block_size, 2, num_kv_heads,
        head_dim]; None where the layout does not say where heads and tokens are."""
        if self.contiguous:
            return self.block_shape
        if self.heads_first:
            return heads_first_coded_shape(self.num_layers, self.layer_block_shape)
        return None

    def layer_view(self, layer: int) -> Any:
        """[num_blocks, *layer_block_shape]: layer `layer` of every block (a strided view of
        the contiguous tensor, or that layer's own tensor)."""
        if self.contiguous:
            return self.tensors[0][:, layer]
        return self.tensors[layer]

    def describe(self) -> str:
        """For the fingerprint: what a block's bytes mean depends on all of this."""
        kind = "contiguous" if self.contiguous else "per-layer"
        return (f"{kind}:L{self.num_layers}:{'x'.join(map(str, self.layer_block_shape))}:"
                f"{str(self.dtype).removeprefix('torch.')}")


def _in_layer_order(layers: Mapping[str, Any]) -> list[Any]:
    """Values ordered by the first integer in each name, or as given if a name has none."""
    indexed = []
    for name in layers:
        found = re.search(r"\d+", name)
        if found is None:
            return list(layers.values())
        indexed.append((int(found.group()), name))
    if len({i for i, _ in indexed}) != len(indexed):
        return list(layers.values())
    return [layers[name] for _, name in sorted(indexed)]


def heads_first_coded_shape(num_layers: int, layer_block_shape: tuple[int, ...]
                            ) -> tuple[int, ...]:
    """A block of heads-first layers ([num_kv_heads, block_size, 2 * head_dim] each) as the
    8-bit codec reads it, [num_layers, block_size, 2, num_kv_heads, head_dim]: one rule for
    the worker, which has the tensors, and the scheduler, which sizes slots without them."""
    heads, tokens, width = layer_block_shape
    return (num_layers, tokens, 2, heads, width // 2)


def as_layout(device: Any) -> KVLayout:
    """`device` itself if it is a layout, else kvtier's own contiguous KV tensor's layout."""
    return device if isinstance(device, KVLayout) else KVLayout.from_contiguous(device)
