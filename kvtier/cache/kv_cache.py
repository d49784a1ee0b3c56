"""Sequences' view of the device pool: block tables, prefix hits, slot allocation.

Primitives: `find_cached_prefix(...)` then `allocate_slots(...)` when a sequence is admitted,
`allocate_slots(...)` each step, `register_full_blocks(...)` after a step, `free(...)` at the
end. Tables are held here by request id, so the sequence object stays free of cache types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.cache.block_pool import BlockPool
from kvtier.cache.block_table import BlockTable
from kvtier.tier import BlockKey, hash_blocks


@dataclass(frozen=True)
class CachedPrefix:
    """What `find_cached_prefix` found: device blocks to share and the tokens they cover,
    plus the keys and tokens of every candidate block (for the tier below to continue)."""

    block_ids: list[int]
    num_tokens: int
    keys: list[BlockKey]
    chunks: list[list[int]]


class KVCacheManager:
    """Owns one `BlockTable` per live request on top of a shared `BlockPool`."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}

    def table(self, request_id: str) -> BlockTable:
        return self.tables.setdefault(request_id, BlockTable())

    def find_cached_prefix(self, namespace: BlockKey, token_ids: Sequence[int]) -> CachedPrefix:
        """Leading full blocks already on the device; at least one token is always left to
        compute, because the sampler needs the last prompt token's logits."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        keys = hash_blocks(namespace, token_ids[: max_blocks * bs], bs)
        chunks = [list(token_ids[i * bs : (i + 1) * bs]) for i in range(max_blocks)]
        hits = self.pool.lookup(keys, chunks)
        return CachedPrefix(hits, len(hits) * bs, keys, chunks)

    def blocks_needed(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None
    ) -> int:
        have = len(self.tables[request_id]) if request_id in self.tables else 0
        have += len(prefix.block_ids) if prefix else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None,
        contiguous: bool = False,
    ) -> bool:
        """Make the table cover `num_tokens` tokens (sharing `prefix` first); False and no
        change if the pool cannot supply the blocks. `contiguous` asks for one run of new
        blocks where the pool has one (a restore is then one copy)."""
        need = self.blocks_needed(request_id, num_tokens, prefix)
        if need > self.pool.num_free - self._revivable(prefix):
            return False
        table = self.table(request_id)
        if prefix is not None and prefix.block_ids:
            assert not table.block_ids, "a cached prefix is only shared into an empty table"
            self.pool.touch(prefix.block_ids)
            table.append(prefix.block_ids)
            table.keys = [self.pool.key[b] for b in prefix.block_ids]  # type: ignore[misc]
            table.num_registered = len(prefix.block_ids)
        new = (self.pool.allocate_run(need) if contiguous else None) or self.pool.allocate(need)
        assert new is not None
        table.append(new)
        return True

    def _revivable(self, prefix: CachedPrefix | None) -> int:
        # Touching a free cached block takes it off the free queue too.
        if prefix is None:
            return 0
        return sum(1 for b in prefix.block_ids if self.pool.ref_cnt[b] == 0)

    def register_full_blocks(
        self, request_id: str, namespace: BlockKey, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Hash and publish every block whose tokens all have KV now."""
        table = self.tables[request_id]
        bs = self.block_size
        full = min(num_computed // bs, len(table))
        if full <= len(table.keys):
            return
        parent = table.keys[-1] if table.keys else None
        new_keys = hash_blocks(
            namespace, token_ids[: full * bs], bs, start=len(table.keys), parent=parent
        )
        table.keys.extend(new_keys)
        for i in range(table.num_registered, full):
            self.pool.register(table.block_ids[i], table.keys[i], token_ids[i * bs : (i + 1) * bs])
        table.num_registered = full

    def published_tokens(self, request_id: str, limit: int) -> int:
        """Tokens of the request's first `limit` in blocks the prefix index holds (0 when
        prefix caching is off: nothing is published)."""
        table = self.tables.get(request_id)
        if table is None or not self.pool.enable_prefix_caching:
            return 0
        return min(table.num_registered * self.block_size, limit // self.block_size
                   * self.block_size)

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first, so shared prefixes stay cached longest."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free(list(reversed(table.clear())))
