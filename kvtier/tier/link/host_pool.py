"""The host tier's memory: one allocation, made once, held for real, reported honestly.

Slot i holds one device block for all layers contiguously, so a block moves as one copy:
    host: [num_slots, num_layers, *layer_block_shape]   (`KVLayout.block_shape`)
With `encoding` (kv_offload_dtype = int8 | fp8) a slot instead holds the block's 8-bit
encoding (`codec.py`): [num_slots, encoded_nbytes] uint8, 4x the blocks per GiB
from float32. Page-locked (pinned) when the device is CUDA, so copies are true async DMA;
plain on CPU.
Pinning registers the exact allocation with `cudaHostRegister` instead of using
`torch.empty(pin_memory=True)`: torch's caching host allocator rounds every pinned
allocation up to a power of two, so a 40 GiB pool would lock 64 GiB of RAM.
"""

from __future__ import annotations

import math
import os
import resource
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.tier.config import GIB, check_fits, host_slot_count
from kvtier.tier.layout import KVLayout, as_layout
from kvtier.tier.link.codec import encoded_nbytes


def rss_bytes() -> int:
    """Resident set size of this process now (peak RSS where /proc is missing)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class HostPool:
    """`num_slots` host slots shaped like one device block each, allocated in the constructor."""

    def __init__(
        self,
        num_slots: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool = False,
        available_bytes: int | None = None,
        encoding: str = "",
        coded_shape: tuple[int, ...] | None = None,
    ) -> None:
        """`coded_shape`: the block as an 8-bit encoding reads it (`block_shape` if None)."""
        if num_slots < 1:
            raise ConfigError(f"a host pool needs at least one slot, got num_slots={num_slots}")
        self.block_shape = tuple(block_shape)  # the device block a slot stands for
        self.dtype = dtype
        self.encoding = encoding
        self.slot_bytes = slot_nbytes(coded_shape or self.block_shape, dtype, encoding)
        row = (self.slot_bytes,) if encoding else self.block_shape
        stored = torch.uint8 if encoding else dtype
        self.num_slots = num_slots
        check_fits(num_slots * self.slot_bytes, available_bytes)
        rss_before = rss_bytes()
        start = time.perf_counter()
        # host: [num_slots, num_layers, block_size, 2, num_kv_heads, head_dim], or
        # [num_slots, encoded_nbytes] uint8 with an encoding
        self.tensor = torch.empty((num_slots, *row), dtype=stored)
        self.tensor.zero_()  # touch every page: the memory is held now, not at first store
        if pin_memory:
            self._unpin = _register_pinned(self, self.tensor)
        self.alloc_seconds = time.perf_counter() - start
        self.rss_growth_bytes = max(0, rss_bytes() - rss_before)
        self.pinned = pin_memory  # registration either succeeded or raised

    @classmethod
    def like(cls, device: KVLayout | torch.Tensor, num_slots: int,
             available_bytes: int | None = None, encoding: str = "") -> HostPool:
        """Slots for the blocks of `device` (a layout, or kvtier's contiguous KV tensor),
        pinned when it lives on CUDA."""
        layout = _encodable(as_layout(device), encoding)
        return cls(num_slots, layout.block_shape, layout.dtype, pin_memory=layout.is_cuda,
                   available_bytes=available_bytes, encoding=encoding,
                   coded_shape=layout.coded_block_shape)

    @classmethod
    def from_size(cls, size_gib: float, device: KVLayout | torch.Tensor,
                  available_bytes: int | None = None, encoding: str = "") -> HostPool:
        """As many slots as fit in `size_gib` (the `kv_offloading_size` knob)."""
        layout = _encodable(as_layout(device), encoding)
        block_bytes = slot_nbytes(layout.coded_block_shape or layout.block_shape, layout.dtype,
                                  encoding)
        check_fits(size_gib * GIB, available_bytes)
        num_slots = host_slot_count(size_gib, block_bytes)
        return cls.like(layout, num_slots, available_bytes, encoding)

    def release(self) -> None:
        """Free the pool's memory now (unpinning it first on CUDA); the pool is unusable after."""
        if self.pinned:
            self._unpin()  # unregisters the pages, then lets the finalizer drop its reference
            self.pinned = False
        self.tensor = self.tensor.new_empty((0, *self.tensor.shape[1:]))
        self.num_slots = 0

    @property
    def allocated_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, i: int) -> torch.Tensor:
        """Slot i: a [num_layers, block_size, 2, num_kv_heads, head_dim] view, or its encoded
        bytes with an encoding."""
        return self.tensor[i]

    def stats(self) -> dict[str, int]:
        """What this pool holds, for /metrics and the benchmark report."""
        return {
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "allocated_bytes": self.allocated_bytes,
            "pinned_bytes": self.allocated_bytes if self.pinned else 0,
            "rss_growth_bytes": self.rss_growth_bytes,
        }


def _encodable(layout: KVLayout, encoding: str) -> KVLayout:
    """`layout`, or a ConfigError where an 8-bit encoding cannot read its blocks."""
    if encoding and layout.coded_block_shape is None:
        raise ConfigError(
            f"kv_offload_dtype={encoding} encodes kvtier's own contiguous KV layout and "
            f"vLLM's heads-first one only (this one is {layout.describe()}); unset "
            f"kv_offload_dtype")
    return layout


def slot_nbytes(block_shape: tuple[int, ...], dtype: torch.dtype, encoding: str = "") -> int:
    """Bytes of one host slot: the device block's, or its 8-bit encoding's."""
    if encoding:
        return encoded_nbytes(block_shape, encoding)
    return math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()


def _register_pinned(owner: object, tensor: torch.Tensor) -> weakref.finalize[..., Any]:
    """Page-lock exactly `tensor`'s bytes until `owner` is collected (ConfigError on failure)."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)  # 0: cudaHostRegisterDefault
    if int(err) != 0:
        raise ConfigError(
            f"could not pin a host pool of {nbytes / GIB:.2f} GiB (cudaHostRegister error "
            f"{int(err)}); lower kv_offloading_size or raise the locked-memory limit (ulimit -l)"
        )
    # The finalizer holds the tensor, so the pages are unregistered before they can be freed.
    finalizer = weakref.finalize(owner, _unregister, cudart, ptr, tensor)
    finalizer.atexit = False
    return finalizer


def _unregister(cudart: object, ptr: int, tensor: torch.Tensor) -> None:
    """Undo `cudaHostRegister`; `tensor` is an argument only to keep its memory alive until now."""
    cudart.cudaHostUnregister(ptr)  # type: ignore[attr-defined]
