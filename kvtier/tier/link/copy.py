"""The copy primitives over a `KVLayout`, chosen by device: whole blocks, one layer of n.

Primitives:
  move_blocks / move_layer                          what the link calls: the plain copies
                                                    below, or the 8-bit ones at the end
  block_runs(blocks, slots)                         pairs grouped into runs of consecutive ids
  copy_blocks(layout, host, blocks, slots, store)   whole blocks, all layers: one copy per
                                                    run (contiguous layout, or layers evenly
                                                    spaced in one allocation), else per run
                                                    and layer; a `CopyTeam` shares them
                                                    between threads
  copy_layer(layout, host, layer, blocks, slots)    layer `layer` of n blocks, host -> device

Measured on this repo's CPU box (1 thread, the CPU shared; SmolLM2 blocks: 30 layers x 16
tokens x 2 x 3 heads x 64 dims fp32 = 737,280 B), 100 blocks, median of 15:
  whole blocks, scattered ids and slots:
    one copy_ per run of consecutive ids     5.6-6.5 ms  11.4-13.1 GB/s   <- chosen
    one copy_ per block                      5.9-9.7 ms   7.6-12.6 GB/s
    index_copy_(0, slots, index_select(ids))  40.7 ms     1.8 GB/s  (gathers into a temporary)
    host[slots] = kv[ids]                     47.7 ms     1.5 GB/s
    index_copy_ per chunk of 16               10.6 ms     7.0 GB/s
  all 30 layers one after another (a layerwise load of the same 100 blocks):
    index_copy_ into the layer view          12.3-13.0 ms  5.7-6.0 GB/s   <- chosen on CPU
    one copy_ per (block, layer), 24.5 KB    21.2-22.1 ms  3.3-3.5 GB/s
With 2 intra-op threads on the same (loaded) 2-core box every primitive was erratic
(0.1-10 GB/s): the copies split across OpenMP threads that compete with other processes.
On CUDA the same calls run with non_blocking=True from pinned memory on the caller's current
stream (the engine's side stream): whole blocks are one cudaMemcpyAsync per run; a layer is
one cudaMemcpyAsync per block (a run's layer slice is strided, which torch would stage
through a pageable temporary), so layerwise loads pay per-copy overhead on small pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.tier.layout import KVLayout
from kvtier.tier.link.codec import decode, decode_layer, encode_into
from kvtier.tier.link.threads import use_one_thread

Run = tuple[int, int, int]  # (first device block, first host slot, number of blocks)


def block_runs(device_blocks: Sequence[int], host_slots: Sequence[int]) -> list[Run]:
    """Pairs (block i, slot i) grouped where both ids go up by one: each run is one copy."""
    runs: list[Run] = []
    for b, s in zip(device_blocks, host_slots):
        if runs:
            b0, s0, n = runs[-1]
            if b == b0 + n and s == s0 + n:
                runs[-1] = (b0, s0, n + 1)
                continue
        runs.append((b, s, 1))
    return runs


Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source) of one copy_
TEAM_MIN_BYTES = 4 << 20  # below this a hand-off to another thread costs more than it saves


class CopyTeam:
    """Threads that share one large CPU copy (each with one OpenMP thread). 94 MB into vLLM's
    CPU cache (16 scattered 128-token blocks, one strided copy each), p50 on the 2-core box:
    10.6 ms on one thread, 7.9 ms on two, 7.1 ms for one contiguous two-thread copy
    (`python benchmarks/copy_paths.py`, 2026-12-02). For a copy nothing computes beside:
    a whole-block load a request waits on. Layer-wise loads (they overlap compute by design)
    and stores (background work) keep one thread."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, "kvtier-copy", use_one_thread)
                      if self.threads > 1 else None)

    def run(self, pairs: Sequence[Pair], non_blocking: bool = False) -> None:
        total = sum(d.numel() * d.element_size() for d, _ in pairs)
        if self._pool is None or non_blocking or total < TEAM_MIN_BYTES:
            _copy_all(pairs, non_blocking)
            return
        groups = _share(pairs, self.threads)
        others = [self._pool.submit(_copy_all, g) for g in groups[1:]]
        _copy_all(groups[0])
        for f in others:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy_all(pairs: Sequence[Pair], non_blocking: bool = False) -> None:
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)


def _share(pairs: Sequence[Pair], n: int) -> list[list[Pair]]:
    """`pairs` dealt into `n` groups of about equal bytes, a pair split along its first
    dimension where there are fewer pairs than groups."""
    pieces: list[Pair] = []
    for dst, src in pairs:
        k = min(n, dst.shape[0]) if len(pairs) < n and dst.dim() else 1
        edges = [dst.shape[0] * i // k for i in range(k + 1)]
        pieces += [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(edges)]
    groups: list[list[Pair]] = [[] for _ in range(n)]
    load = [0] * n
    for dst, src in sorted(pieces, key=lambda p: -p[0].numel()):
        i = load.index(min(load))
        groups[i].append((dst, src))
        load[i] += dst.numel()
    return groups


def copy_blocks(
    layout: KVLayout,
    host: torch.Tensor,
    device_blocks: Sequence[int],
    host_slots: Sequence[int],
    store: bool,
    team: CopyTeam | None = None,
) -> int:
    """Whole blocks: host[slot i] <- block i when `store`, else the reverse; returns bytes.
    `team`: threads that share the copies (CPU).

    host: [num_slots, num_layers, *layer_block_shape]
    """
    non_blocking = layout.is_cuda
    stacked = None if layout.contiguous or non_blocking else stacked_layers(layout)
    copies: list[Pair] = []
    for b, s, n in block_runs(device_blocks, host_slots):
        if stacked is not None:  # every layer of the run in one strided copy
            pairs = [(stacked[:, b : b + n], host[s : s + n].transpose(0, 1))]
        elif layout.contiguous:
            # kv: [num_blocks, num_layers, *layer_block_shape]; both sides one memcpy
            pairs = [(layout.tensors[0][b : b + n], host[s : s + n])]
        elif not non_blocking:  # a layer's run is contiguous on the device, strided on host
            pairs = [(t[b : b + n], host[s : s + n, layer])
                     for layer, t in enumerate(layout.tensors)]
        else:  # CUDA: contiguous pieces only (a strided pinned view would be staged through
            # a pageable temporary), one per (block, layer)
            pairs = [(t[b + i], host[s + i, layer]) for i in range(n)
                     for layer, t in enumerate(layout.tensors)]
        copies += [(hst, dev) if store else (dev, hst) for dev, hst in pairs]
    if team is not None:
        team.run(copies, non_blocking)
    else:
        _copy_all(copies, non_blocking)
    return len(device_blocks) * layout.block_nbytes


def stacked_layers(layout: KVLayout) -> torch.Tensor | None:
    """Per-layer CPU tensors that lie evenly spaced in one allocation (vLLM 0.32's CPU
    cache) as one strided view [num_layers, num_blocks, *layer_block_shape]; None for any
    other placement. One copy per run of blocks instead of one per run and layer: 16
    scattered 5.9 MB blocks were 480 calls of 196 KB, each a GIL hand-off between the copy
    threads (5.9 GB/s on two threads); 16 calls copy 12 GB/s, one contiguous copy 13."""
    first = layout.tensors[0]
    if len(layout.tensors) < 2:
        return None
    item = first.element_size()
    step, rest = divmod(layout.tensors[1].data_ptr() - first.data_ptr(), item)
    storage = first.untyped_storage()
    if rest or step < first.numel() or any(
            t.data_ptr() != first.data_ptr() + i * step * item
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            for i, t in enumerate(layout.tensors)):
        return None
    stacked: torch.Tensor = first.as_strided((layout.num_layers, *first.shape),
                                             (step, *first.stride()))
    return stacked


def layer_index(
    device_blocks: Sequence[int], host_slots: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors for `copy_layer` on CPU, built once per job rather than once per layer."""
    return (torch.tensor(device_blocks, dtype=torch.long),
            torch.tensor(host_slots, dtype=torch.long))


def copy_layer(
    layout: KVLayout,
    host: torch.Tensor,
    layer: int,
    device_blocks: Sequence[int],
    host_slots: Sequence[int],
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> int:
    """Layer `layer` of n blocks, host -> device (a layerwise load); returns bytes."""
    dev = layout.layer_view(layer)  # [num_blocks, *layer_block_shape]
    if layout.is_cuda:
        for b, s in zip(device_blocks, host_slots):
            dev[b].copy_(host[s, layer], non_blocking=True)  # contiguous piece
    elif device_blocks:
        blocks, slots = index if index is not None else layer_index(device_blocks, host_slots)
        dev.index_copy_(0, blocks, host[:, layer].index_select(0, slots))
    return len(device_blocks) * layout.layer_block_nbytes


def move_blocks(layout: KVLayout, host: torch.Tensor, device_blocks: Sequence[int],
                host_slots: Sequence[int], store: bool, encoding: str = "",
                team: CopyTeam | None = None) -> int:
    """Whole blocks between the device and the host pool, plain or 8-bit (`encoding`)."""
    if encoding:
        return code_blocks(layout, host, device_blocks, host_slots, store, encoding)
    return copy_blocks(layout, host, device_blocks, host_slots, store, team)


def move_layer(layout: KVLayout, host: torch.Tensor, layer: int,
               device_blocks: Sequence[int], host_slots: Sequence[int],
               index: tuple[torch.Tensor, torch.Tensor] | None, encoding: str = "") -> int:
    """One layer of a layerwise load, from a plain or an 8-bit host pool."""
    if encoding:
        return decode_layer_blocks(layout, host, layer, device_blocks, host_slots, encoding)
    return copy_layer(layout, host, layer, device_blocks, host_slots, index)


def code_blocks(layout: KVLayout, host: torch.Tensor, device_blocks: Sequence[int],
                host_slots: Sequence[int], store: bool, encoding: str) -> int:
    """Whole blocks through an 8-bit host pool (`kv_offload_dtype`, contiguous layout): a
    store encodes each block into its slot, a load decodes it back; returns the bytes the
    host side moved.

    host: [num_slots, encoded_nbytes] uint8
    A heads-first per-layer layout (vLLM's) goes through one staging block in the codec's
    order, [num_layers, block_size, 2, num_kv_heads, head_dim], gathered from (or scattered
    back to) each layer's [num_kv_heads, block_size, 2 * head_dim] run.
    """
    if layout.contiguous:
        kv = layout.tensors[0]
        for b, s in zip(device_blocks, host_slots):
            if store:
                encode_into(kv[b], host[s], encoding)
            else:
                decode(host[s].numpy(), kv[b], encoding)
        return len(device_blocks) * host.shape[1]
    shape = layout.coded_block_shape
    assert shape is not None  # the link refuses an encoding without one
    staging = torch.empty(shape, dtype=layout.dtype)
    _, tokens, _, heads, dim = shape
    for b, s in zip(device_blocks, host_slots):
        # each layer's [heads, tokens, 2 * dim] run seen as [tokens, 2, heads, dim]
        runs = [layout.layer_view(layer)[b].view(heads, tokens, 2, dim).permute(1, 2, 0, 3)
                for layer in range(layout.num_layers)]
        if store:
            for layer, run in enumerate(runs):
                staging[layer].copy_(run)
            encode_into(staging, host[s], encoding)
        else:
            decode(host[s].numpy(), staging, encoding)
            for layer, run in enumerate(runs):
                run.copy_(staging[layer])
    return len(device_blocks) * host.shape[1]


def decode_layer_blocks(layout: KVLayout, host: torch.Tensor, layer: int,
                        device_blocks: Sequence[int], host_slots: Sequence[int],
                        encoding: str) -> int:
    """Layer `layer` of n blocks decoded from an 8-bit host pool (a layerwise load)."""
    kv = layout.tensors[0]
    for b, s in zip(device_blocks, host_slots):
        decode_layer(host[s], kv[b, layer], layer, layout.num_layers, encoding)
    return len(device_blocks) * host.shape[1] // layout.num_layers
