"""Paged attention equals dense causal attention for any block layout, batch mix and chunking."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model.attention import build_metadata, paged_attention

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BS = 2, 2, 3, 8, 4
HEADS = KV_HEADS * GROUP


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """Textbook attention of queries at positions q_pos over keys 0..len(k)-1."""
    k = k.repeat_interleave(GROUP, dim=1)
    v = v.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    allowed = torch.arange(k.shape[0])[None, :] <= torch.tensor(q_pos)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 23), st.integers(1, 9)), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
    invariant=st.booleans(),
)
def test_paged_attention_matches_dense(
    seqs: list[tuple[int, int]], seed: int, invariant: bool
) -> None:
    # each sequence: (tokens already cached, new tokens this step); new == 1 is a decode
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // BS) for c, n in seqs]
    num_blocks = sum(need) + 3
    # kv: [num_blocks, num_layers, block_size, 2, kv_heads, head_dim]
    kv = torch.randn(num_blocks, LAYERS, BS, 2, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered physical blocks
    layer = int(torch.randint(0, LAYERS, (1,), generator=gen))
    tables, keys, values = [], [], []
    for (cached, new), nb in zip(seqs, need):
        table = [order.pop() for _ in range(nb)]
        k = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen)
        for p in range(cached):  # the prefix is already in its blocks
            kv[table[p // BS], layer, p % BS, 0] = k[p]
            kv[table[p // BS], layer, p % BS, 1] = v[p]
        tables.append(table)
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(n for _, n in seqs), HEADS, HEAD_DIM, generator=gen)
    chunks = [(c, n, t) for (c, n), t in zip(seqs, tables)]
    meta = build_metadata(chunks, BS, torch.device("cpu"), invariant=invariant)
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, keys)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, values)])
    out = paged_attention(kv, layer, meta, q, new_k, new_v, HEAD_DIM**-0.5)
    row = 0
    for (cached, new), table, k, v in zip(seqs, tables, keys, values):
        ref = dense(q[row : row + new], k, v, list(range(cached, cached + new)))
        torch.testing.assert_close(out[row : row + new], ref, rtol=1e-5, atol=1e-5)
        # and the new keys and values landed in their slots
        for p in range(cached, cached + new):
            assert torch.equal(kv[table[p // BS], layer, p % BS, 0], k[p])
            assert torch.equal(kv[table[p // BS], layer, p % BS, 1], v[p])
        row += new
