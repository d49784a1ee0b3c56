"""kvtier's host and disk residency as vLLM's KV events, so that routers which place requests
by where a prefix lives (llm-d's precise prefix-cache scorer, NVIDIA Dynamo) see kvtier's tiers
beside vLLM's GPU blocks: `BlockStored` when a block's host store lands (medium CPU) or its disk
write does (STORAGE), `BlockRemoved` when that tier evicts or removes it.

  storing(request, blocks, keys)    the scheduler side handed these blocks to the host tier
  fetching(request, blocks, keys)   a fetch below host may bring these blocks up to host
  settled(request)                  the request was admitted or left: its fetch is over
  take(changes) -> [event]          the tier's residency changes as vLLM's events, in order
  reset()                           the cache was reset: the next `take` starts with vLLM's
                                    `AllBlocksCleared` (as vLLM's own block pool sends on a
                                    reset), and nothing published before is withdrawn again
The tier knows a block by kvtier's key; vLLM's routers by vLLM's block hash. So each block's
identity as vLLM publishes it (a `BlockOrigin`: its hash, its parent's, its tokens, LoRA, extra
keys, KV cache group) is captured from the live request when kvtier takes the block, since the
store (and the disk write after it) lands after the request may have finished. An origin is
kept while its block is resident on a published medium, or on its way to host, and dropped
after: bounded by the tiers' slots. Never published: the remote tier (every instance sharing
it would claim its blocks), and blocks whose origin kvtier never saw: those found on disk after
a restart (the requests that named them are gone) and those fetched up for a request that left
before the fetch landed. One key has one origin, the first request's that named it (two LoRA
names of one adapter's files share kvtier's keys, not vLLM's hashes: the first name is kept).
vLLM-free (its event classes are given), so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.tier import BlockKey, ChangeKind, Medium, ResidencyChange

ExternalHash = int | bytes  # vLLM publishes a block hash as an int (its default) or bytes
Blocks = Sequence[tuple[int, int]]  # (KV cache group, block index) of one request
GroupKeys = Sequence[Sequence[BlockKey]]  # per group, its keys by block index


@dataclass(frozen=True)
class BlockOrigin:
    """What vLLM's own `BlockStored` says of one block, as vLLM computed it for its GPU copy."""

    block_hash: ExternalHash
    parent_hash: ExternalHash | None  # None for a prompt's first block
    token_ids: tuple[int, ...]
    group_idx: int  # the KV cache group: one hash is one block per group
    spec_kind: str | None = None  # the group's kind of KV ("full_attention", ...)
    sliding_window: int | None = None  # the group's window, if it has one
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # as vLLM publishes them (cache_salt, LoRA name)
    session_id: str | None = None


# (request id, KV cache group, block index) -> that block's origin; None when the request is
# gone or vLLM has no hash for the block
OriginOf = Callable[[str, int, int], BlockOrigin | None]


class BlockRecorder(Protocol):
    """Whom the scheduler side tells which blocks it hands the tier (`KVEvents`)."""

    def storing(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None: ...

    def fetching(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None: ...

    def settled(self, request_id: str) -> None: ...


class Unpublished:
    """The recorder when vLLM publishes no KV events: it keeps nothing."""

    def storing(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None:
        return

    def fetching(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None:
        return

    def settled(self, request_id: str) -> None:
        return


UNPUBLISHED = Unpublished()


@dataclass
class _Block:
    """A block kvtier may publish: its origin, and where it stands."""

    origin: BlockOrigin
    media: set[Medium] = field(default_factory=set)  # published as resident there
    storing: bool = False  # a host store was decided and has not landed (or failed)
    fetchers: int = 0  # requests whose fetch may bring it up to host

    @property
    def unused(self) -> bool:
        return not self.media and not self.storing and not self.fetchers


class KVEvents:
    """Residency changes -> vLLM KV events, with the origins kept between the two."""

    def __init__(self, origin_of: OriginOf, block_size: int, media: Mapping[Medium, str],
                 stored: Callable[..., Any], removed: Callable[..., Any],
                 cleared: Callable[[], Any] | None = None) -> None:
        """`media`: the tiers published, by the medium name vLLM's events carry (host "CPU",
        disk "STORAGE"); `stored`, `removed`, `cleared`: vLLM's `BlockStored`, `BlockRemoved`
        and `AllBlocksCleared`."""
        self._origin_of = origin_of
        self.block_size = block_size
        self._media = dict(media)
        self._stored = stored
        self._removed = removed
        self._cleared = cleared
        self._reset = False  # a reset since the last take
        self._blocks: dict[BlockKey, _Block] = {}
        self._fetches: dict[str, list[BlockKey]] = {}  # request -> keys its fetch counts on

    @property
    def kept(self) -> int:
        """Blocks whose origin is kept: what this costs in memory, bounded by the tiers."""
        return len(self._blocks)

    # -- what the scheduler side hands the tier -------------------------------------------

    def storing(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None:
        """The host tier took these blocks of the request (stored, or already held)."""
        for g, i in blocks:
            entry = self._entry(request_id, g, i, keys[g][i])
            if entry is not None and Medium.HOST not in entry.media:
                entry.storing = True  # cleared by the host's next change of the key

    def fetching(self, request_id: str, blocks: Blocks, keys: GroupKeys) -> None:
        """A fetch below host started for the request: any of these may land on host."""
        if request_id in self._fetches:
            return  # asked again while it is on its way: counted once
        counted = []
        for g, i in blocks:
            key = keys[g][i]
            entry = self._entry(request_id, g, i, key)
            if entry is not None and Medium.HOST not in entry.media:
                entry.fetchers += 1
                counted.append(key)
        self._fetches[request_id] = counted

    def settled(self, request_id: str) -> None:
        """The request was admitted or left: what its fetch did not bring up is forgotten."""
        for key in self._fetches.pop(request_id, ()):
            entry = self._blocks[key]
            entry.fetchers -= 1
            self._forget_unused(key, entry)

    def _entry(self, request_id: str, group: int, index: int, key: BlockKey) -> _Block | None:
        entry = self._blocks.get(key)
        if entry is None:
            origin = self._origin_of(request_id, group, index)
            if origin is None:
                return None
            entry = self._blocks[key] = _Block(origin)
        return entry

    def reset(self) -> None:
        """Every block published so far is gone for routers (the keys they were stored under
        are never asked for again): one `AllBlocksCleared`, and no origin kept."""
        self._blocks.clear()
        self._fetches.clear()
        self._reset = self._cleared is not None

    # -- what the tier did ------------------------------------------------------------------

    def take(self, changes: Sequence[ResidencyChange]) -> list[Any]:
        """vLLM's events for `changes`; a chain of blocks stored together is one event, as
        vLLM sends its own."""
        runs: list[tuple[ChangeKind, str, list[BlockOrigin]]] = []
        cleared = []
        if self._reset and self._cleared is not None:
            cleared, self._reset = [self._cleared()], False
        for change in changes:
            entry = self._blocks.get(change.key)
            if entry is None:
                continue  # an origin never seen: not published (module doc)
            if change.medium is Medium.HOST:
                entry.storing = False  # what was awaited there landed, failed or left
            name = self._media.get(change.medium)
            if name is not None and self._published(entry, change):
                _add(runs, change.kind, name, entry.origin)
            self._forget_unused(change.key, entry)
        return cleared + [self._event(kind, name, run) for kind, name, run in runs]

    def _published(self, entry: _Block, change: ResidencyChange) -> bool:
        """Apply `change` to where `entry` is published; whether that is news."""
        if change.kind is ChangeKind.STORED and change.medium not in entry.media:
            entry.media.add(change.medium)
            return True
        if change.kind is ChangeKind.REMOVED and change.medium in entry.media:
            entry.media.discard(change.medium)
            return True
        return False  # a failed store, or nothing announced there to withdraw

    def _forget_unused(self, key: BlockKey, entry: _Block) -> None:
        if entry.unused:
            del self._blocks[key]

    def _event(self, kind: ChangeKind, medium: str, run: list[BlockOrigin]) -> Any:
        first = run[0]
        hashes = [o.block_hash for o in run]
        if kind is ChangeKind.REMOVED:
            return self._removed(block_hashes=hashes, medium=medium, group_idx=first.group_idx)
        return self._stored(
            block_hashes=hashes, parent_block_hash=first.parent_hash,
            token_ids=[t for o in run for t in o.token_ids], block_size=self.block_size,
            lora_id=first.lora_id, medium=medium, lora_name=first.lora_name,
            extra_keys=[o.extra_keys for o in run], group_idx=first.group_idx,
            kv_cache_spec_kind=first.spec_kind,
            kv_cache_spec_sliding_window=first.sliding_window, session_id=first.session_id)


def _add(runs: list[tuple[ChangeKind, str, list[BlockOrigin]]], kind: ChangeKind, medium: str,
         origin: BlockOrigin) -> None:
    """Append `origin` to the last run when it continues it: the same change, medium and KV
    cache group, and for a store the next block of the same chain, LoRA and session."""
    if runs:
        last_kind, last_medium, run = runs[-1]
        last = run[-1]
        if (last_kind is kind and last_medium == medium and last.group_idx == origin.group_idx
                and (kind is ChangeKind.REMOVED or _continues(last, origin))):
            run.append(origin)
            return
    runs.append((kind, medium, [origin]))


def _continues(last: BlockOrigin, origin: BlockOrigin) -> bool:
    return (origin.parent_hash == last.block_hash and origin.lora_id == last.lora_id
            and origin.lora_name == last.lora_name and origin.session_id == last.session_id)
