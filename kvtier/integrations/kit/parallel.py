"""How vLLM splits the model over worker ranks, and each rank's share of kvtier's sizes.

Tensor parallelism is served: every rank holds its own heads of every block, so each rank keeps
its own slice in its own host pool, disk file (`disk_kv_path/rank{r}`, locked by that rank's
process) and Redis key space, under keys that name tokens only (the scheduler computes them
once) and a fingerprint that names the split. `kv_offloading_size` and `disk_kv_size` are the
totals across ranks, as vLLM's own offloading reads `kv_offloading_size`: each rank takes an
equal share. Pipeline and context parallelism are refused at start by name. Pure Python over
vLLM's config attributes: tested without vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig, configured_stores

REFUSED = {  # vLLM's parallel size -> why kvtier cannot serve it yet
    "pipeline_parallel_size": "each stage holds other layers, and the scheduler sizes a block "
                              "from rank 0's layers only",
    "prefill_context_parallel_size": "each rank holds other tokens of a block",
    "decode_context_parallel_size": "each rank holds other tokens of a block",
}


@dataclass(frozen=True)
class Split:
    """The model's split over workers: `world_size` ranks, all tensor parallel."""

    tensor_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def describe(self) -> str:
        """What the fingerprint names ("" for one worker: one worker's blocks are whole)."""
        return "" if self.world_size == 1 else f"tp={self.tensor_parallel_size}"

    @classmethod
    def of(cls, parallel_config: Any) -> Split:
        """The split vLLM runs; ConfigError naming a size kvtier cannot serve."""
        for name, why in REFUSED.items():
            value = int(getattr(parallel_config, name, 1) or 1)
            if value != 1:
                raise ConfigError(f"kvtier's connector does not serve {name}={value} yet "
                                  f"({why}); run with {name}=1 (tensor parallelism is "
                                  f"supported), or unset kv_transfer_config")
        return cls(int(parallel_config.tensor_parallel_size))

    def share(self, config: TierConfig, rank: int) -> TierConfig:
        """`rank`'s share of the tier: 1/world of the host size, and each store's share as the
        store says (the disk's: 1/world of its size, a directory of the rank's own).
        Unchanged for one worker (its disk file stays where it was)."""
        if self.world_size == 1:
            return config
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"vLLM worker rank {rank} is outside a world of "
                              f"{self.world_size}")
        stores = {store.key: store.kind.rank_share(store.knobs, rank, self.world_size)
                  for store in configured_stores(config)}
        return dataclasses.replace(
            config, kv_offloading_size=config.kv_offloading_size / self.world_size,
            kv_stores=stores)
