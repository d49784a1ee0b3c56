"""The namespace every cached block lives in: change any field and no old block can be found."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace

from kvtier.tier.keys import BlockKey

KV_LAYOUT_VERSION = 1  # bump when the KV memory layout changes
FORMAT_VERSION = 2  # bump when the stored block format changes (2: a MAC field)


@dataclass(frozen=True)
class Fingerprint:
    """Everything that decides whether cached KV bytes are valid for this engine."""

    weights_digest: str
    architecture: str  # ModelSpec.describe(): every hyperparameter that changes numerics
    kv_dtype: str
    block_size: int
    tokenizer_digest: str
    attention_backend: str = "torch-sdpa"
    adapter: str = ""
    kv_offload_encoding: str = ""  # lossy encoding of blocks below the device, "" = exact
    # How the model is split over workers ("tp=2,pp=1"; "" = one worker): a tensor-parallel
    # rank holds only its heads, so its bytes mean nothing under another split.
    parallel: str = ""
    # Which worker's slice a stored block is ("" in chain seeds: keys name tokens, not ranks).
    shard: str = ""
    # Read when an engine is built (not when this module is imported), so a test can bump them.
    kv_layout_version: int = field(default_factory=lambda: KV_LAYOUT_VERSION)
    format_version: int = field(default_factory=lambda: FORMAT_VERSION)

    def namespace(self, salt: str = "") -> BlockKey:
        """Seed of the block-hash chain; `salt` separates tenants and per-request cache salts."""
        h = hashlib.blake2b(digest_size=16)
        for key, value in sorted(asdict(self).items()):
            h.update(f"{key}={value}\x00".encode())
        h.update(b"salt=" + salt.encode())
        return h.digest()

    def of_shard(self, shard: str) -> Fingerprint:
        """The same fingerprint naming one worker's slice: what that worker's stored blocks
        carry (and Redis keys start with), so one rank's bytes are never read as another's."""
        return replace(self, shard=shard)
