"""TierWorker round trips, byte for byte, over both KV layouts it knows: kvtier's one
contiguous tensor and vLLM's one tensor per layer ([num_blocks, heads, block_size, 2*dim])."""

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tier import Job, KVLayout, Medium, TierWorker
from kvtier.tier.io.thread import TierIO
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.transfer import TransferEngine

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 10, 2, 4, 8
NS = b"\x00" * 16  # the namespace blocks below host would carry (none here)


def contiguous() -> KVLayout:
    # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]
    kv = torch.randn(BLOCKS, LAYERS, BS, 2, HEADS, DIM)
    return KVLayout.from_contiguous(kv)


def per_layer() -> KVLayout:
    # vLLM CPU: {"model.layers.{i}.self_attn.attn": [num_blocks, heads, block_size, 2*dim]},
    # handed over out of order to check the ordering by layer index
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BS, 2 * DIM)
              for i in (2, 0, 1)}
    layout = KVLayout.from_layers(layers)
    assert [t.data_ptr() for t in layout.tensors] == [
        layers[f"model.layers.{i}.self_attn.attn"].data_ptr() for i in range(LAYERS)]
    return layout


def block(layout: KVLayout, b: int) -> torch.Tensor:
    return torch.stack([layout.layer_view(layer)[b] for layer in range(LAYERS)])


def worker(layout: KVLayout, slots: int = 6) -> TierWorker:
    host = HostPool.like(layout, slots)
    return TierWorker(host, TransferEngine(layout, host, blocks_per_chunk=2), TierIO(host, NS))


@pytest.mark.parametrize("make", [contiguous, per_layer], ids=["contiguous", "per-layer"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_store_then_load_elsewhere_is_byte_exact(make, layerwise: bool) -> None:
    layout = make()
    w = worker(layout)
    before = {b: block(layout, b).clone() for b in (1, 2, 5)}
    try:
        # device [1, 2, 5] -> host [0, 1, 4] (runs and a gap), then host -> device [6, 7, 9]
        w.submit(Job(0, Medium.DEVICE, Medium.HOST, (0, 1, 4), device_blocks=(1, 2, 5)))
        assert w.wait(0).success
        w.submit(Job(1, Medium.HOST, Medium.DEVICE, (0, 1, 4), device_blocks=(6, 7, 9),
                     layerwise=layerwise))
        if layerwise:
            assert all(w.wait_layer(1, layer) for layer in range(LAYERS))
        result = w.wait(1)
        assert result.success and result.ok == (True,) * 3
        assert result.nbytes == 3 * layout.block_nbytes
        for src, dst in ((1, 6), (2, 7), (5, 9)):
            assert torch.equal(block(layout, dst), before[src])
            assert torch.equal(block(layout, src), before[src])  # the source is untouched
        assert not w.busy and w.poll() == []
    finally:
        assert w.close() == []


def test_layout_bytes_and_shapes() -> None:
    a, b = contiguous(), per_layer()
    assert a.block_shape == (LAYERS, BS, 2, HEADS, DIM)
    assert b.block_shape == (LAYERS, HEADS, BS, 2 * DIM)
    assert a.block_nbytes == b.block_nbytes == LAYERS * BS * 2 * HEADS * DIM * 4
    assert a.describe() != b.describe()


def test_layers_that_differ_or_are_not_contiguous_are_refused() -> None:
    with pytest.raises(ConfigError, match="every layer must be alike"):
        KVLayout.from_layers([torch.zeros(4, 2, 8), torch.zeros(4, 2, 9)])
    with pytest.raises(ConfigError, match="contiguous"):
        KVLayout.from_layers([torch.zeros(8, 4).t()])
    with pytest.raises(ConfigError, match="no KV tensors"):
        KVLayout.from_layers({})


def test_a_failed_job_comes_back_as_a_failed_result() -> None:
    layout = per_layer()
    host = HostPool.like(layout, 4)
    w = TierWorker(host, TransferEngine(layout, host, fault=lambda spec, step: True),
                   TierIO(host, NS))
    try:
        w.submit(Job(7, Medium.DEVICE, Medium.HOST, (0,), device_blocks=(3,)))
        result = w.wait(7)
        assert result.job_id == 7 and not result.success and result.reasons[0]
    finally:
        w.close()


def test_eight_bit_encoding_needs_the_contiguous_layout() -> None:
    with pytest.raises(ConfigError, match="contiguous KV layout"):
        HostPool.like(per_layer(), 2, encoding="int8")
    with pytest.raises(ConfigError, match="contiguous KV layout"):
        HostPool.from_size(0.01, per_layer(), encoding="int8")
