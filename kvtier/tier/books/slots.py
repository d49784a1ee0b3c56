"""Bookkeeping of a tier made of numbered slots: which key sits in which slot, what is pinned.

Slot i is row i of the host pool (HostTier) or slot i of the disk file (DiskTier); this
module only hands slots out, pins them while a copy is in flight, and evicts through the
configured policy, fairly across tenants (`tenancy.py`): a tenant over its quota loses
blocks first, and a retained block goes last, only where a tier below keeps it (host) and
never before its deadline otherwise. Within those rules a prefix goes from its tail: a block
that another block here continues (its child, told by the store) goes only after that one,
since a prefix cannot skip a block and a lost head would leave the rest held, never served.
Bytes never pass through here. Where a key becomes resident or stops being (a store completes
or fails, an eviction, a removal) it is told to the tier's `ResidencyLog` and to its
`Tenancy`.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.tier.books.policy import Skip, make_policy
from kvtier.tier.books.protocol import PrepareStoreResult
from kvtier.tier.books.residency_log import ChangeKind, ResidencyLog
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import IndexStats

Spill = Callable[[BlockKey], bool]  # True for a key a tier below keeps: the host may let go


@dataclass
class _Entry:
    """A key's slot, the token ids that confirm a hit, and the key before it in its prefix
    (None: a prefix's first block, or not told)."""

    slot: int
    tokens: tuple[int, ...]
    parent: BlockKey | None = None


class SlotTier:
    """Slots 0..num_slots-1 of one tier and the keys they hold (see `protocol.py`)."""

    medium = Medium.DEVICE  # set by each concrete tier
    size_knob = ""  # the knob that sizes the tier, for the error below

    def __init__(self, num_slots: int, policy: str = "lru",
                 log: ResidencyLog | None = None, tenancy: Tenancy | None = None) -> None:
        """`log`: where residency changes go (None: a log that records nothing);
        `tenancy`: owners, quotas and retention, shared by the slot tiers of one manager."""
        if num_slots < 1:
            raise ConfigError(
                f"{self.medium.value} tier num_slots={num_slots} must be >= 1; "
                f"raise {self.size_knob}"
            )
        self.num_slots = num_slots
        self.policy = make_policy(policy, num_slots)
        self._entries: dict[BlockKey, _Entry] = {}  # complete and storing keys
        self._storing: set[BlockKey] = set()  # pinned, not yet visible to lookup
        self._pins: dict[BlockKey, int] = {}  # load pins of complete keys; absent means 0
        self._free: deque[int] = deque(range(num_slots))  # lowest slot first at start
        self._kids: dict[BlockKey, int] = {}  # key -> blocks here whose parent it is
        self._counts = IndexStats(capacity=num_slots)
        self.log = log if log is not None else ResidencyLog(enabled=False)
        self.tenancy = tenancy if tenancy is not None else Tenancy()
        self.tenancy.track(self.medium, num_slots)

    @property
    def stats(self) -> IndexStats:
        """A snapshot: counters so far plus the occupancy and pin gauges now."""
        return replace(
            self._counts, used=len(self._entries), pinned=len(self._storing) + len(self._pins)
        )

    def lookup(
        self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]] | None = None
    ) -> int:
        """How many leading keys are complete (and hold these token ids, when given).

        Takes no pin and records no hit for the policy: call `touch`, then `prepare_load`.
        """
        assert token_chunks is None or len(token_chunks) == len(keys), "one chunk per key"
        hits = 0
        for i, key in enumerate(keys):
            self._counts.lookups += 1
            entry = self._entries.get(key)
            if entry is None or key in self._storing:
                break
            if token_chunks is not None and entry.tokens != tuple(token_chunks[i]):
                self._counts.collisions += 1
                break
            hits += 1
        self._counts.hits += hits
        return hits

    def prepare_store(
        self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]],
        tenant: str = "", spill: Spill | None = None,
        parents: Sequence[BlockKey | None] | None = None,
    ) -> PrepareStoreResult | None:
        """Slots for the keys not yet present (storing ones count as present), pinned until
        `complete_store`; None, with nothing changed, if too few keys can be evicted. Keys
        of this batch that are already present are never evicted to make room. New keys are
        `tenant`'s; `spill` says which retained keys a tier below keeps (host only);
        `parents[i]`: the key before `keys[i]` in its prefix (None: its first block), so
        eviction takes the prefix from its tail."""
        assert len(token_chunks) == len(keys), "one chunk per key"
        assert parents is None or len(parents) == len(keys), "one parent per key"
        new: dict[BlockKey, tuple[tuple[int, ...], BlockKey | None]] = {}
        for i, (key, tokens) in enumerate(zip(keys, token_chunks)):
            if key not in self._entries and key not in new:
                new[key] = (tuple(tokens), parents[i] if parents is not None else None)
        evicted: list[BlockKey] = []
        shortfall = len(new) - len(self._free)
        if shortfall > 0:
            victims = self._victims(shortfall, set(keys), tenant, len(new), spill)
            if victims is None:
                return None
            for key in victims:
                self._forget(key)
            self._counts.evictions += len(victims)
            self.log.record(self.medium, ChangeKind.REMOVED, victims)
            self.tenancy.left(self.medium, victims, evicted=True)
            evicted = victims
        slots = []
        for key, (tokens, parent) in new.items():
            slot = self._free.popleft()
            self._entries[key] = _Entry(slot, tokens, parent)
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
            self._storing.add(key)
            slots.append(slot)
        # a prefix's tail enters the policy first: it is older, so it goes first
        for key in reversed(new) if parents is not None else new:
            self.policy.insert(key)
        self.tenancy.entered(self.medium, new, tenant)
        return PrepareStoreResult(list(new), slots, evicted)

    def _forget(self, key: BlockKey) -> None:
        """`key` leaves its slot (the policy has let it go already)."""
        entry = self._entries.pop(key)
        self._free.append(entry.slot)
        if entry.parent is not None:
            left = self._kids[entry.parent] - 1
            if left:
                self._kids[entry.parent] = left
            else:
                del self._kids[entry.parent]

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        """The key before a present `key` in its prefix (None: its first, or not told)."""
        entry = self._entries.get(key)
        return entry.parent if entry is not None else None

    def _evict(self, m: int, skip: Skip) -> list[BlockKey]:
        """Up to `m` victims in policy order, a prefix from its tail: first blocks that no
        block here continues (a victim's parent may go in the next pass), then, if too few
        can go that way, any the rules let go. The caller has counted what may go."""
        victims: list[BlockKey] = []
        if self._kids:
            kids, entries = self._kids, self._entries
            taken: Counter[BlockKey] = Counter()  # children of a key picked so far

            def continued(k: BlockKey) -> bool:  # True: not a victim of these passes
                held = kids.get(k)  # a child first; then the rules (`skip` may count it)
                if (held and held > taken.get(k, 0)) or skip(k):
                    return True
                parent = entries[k].parent
                if parent is not None:
                    taken[parent] += 1
                return False
            while len(victims) < m:
                got = self.policy.evict(m - len(victims), continued, partial=True)
                if not got:
                    break
                victims += got
        if len(victims) < m:
            victims += self.policy.evict(m - len(victims), skip, partial=True) or []
        return victims

    def _victims(self, n: int, batch: set[BlockKey], tenant: str, incoming: int,
                 spill: Spill | None) -> list[BlockKey] | None:
        """`n` keys to evict, or None (nothing changed) if fewer can go. In order: blocks of
        tenants over their quota, then any unretained block in policy order, then (with
        `spill`) `tenant`'s own retained blocks that a tier below keeps: one tenant's store
        never pushes another's retained blocks off this tier. What can go is counted from the
        retained keys and the batch, never by a scan of the tier's slots."""
        unpinned = len(self._entries) - len(self._storing) - len(self._pins)
        if n > unpinned:
            return None
        tenancy = self.tenancy
        in_batch = sum(1 for k in batch if k in self._entries and not self._pinned(k))
        if not tenancy.quotas and not tenancy.any_retained:  # the plain policy
            if unpinned - in_batch < n:
                return None
            return self._evict(n, lambda k: self._pinned(k) or k in batch)
        retained = tenancy.retained_on(self.medium)

        def kept(k: BlockKey) -> bool:
            return self._pinned(k) or k in batch or k in retained
        own = self._spillable(retained, tenant, spill) - batch

        def spilled(k: BlockKey) -> bool:
            return self._pinned(k) or k in batch or (k in retained and k not in own)
        # unpinned keys each pass must leave: the batch's, and the retained (less `own`)
        out_kept = len(retained) - sum(1 for k in self._pinned_keys() if k in retained) + (
            in_batch - sum(1 for k in batch if k in retained and not self._pinned(k)))
        out_spilled = out_kept - len(own)
        if unpinned - out_spilled < n:
            return None
        victims = self._over_quota(n, kept, tenant, incoming) if tenancy.quotas else []
        for skip, out in ((kept, out_kept), (spilled, out_spilled)):
            if len(victims) < n:  # every victim so far is one both passes could take
                room = unpinned - out - len(victims)
                victims += self._evict(min(n - len(victims), room), skip)
        assert len(victims) == n, "the evictable keys were counted first"
        return victims

    def _spillable(self, retained: AbstractSet[BlockKey], tenant: str, spill: Spill | None
                   ) -> set[BlockKey]:
        """`tenant`'s own unpinned retained keys here that a tier below keeps (`spill`): the
        host may let them go for that tenant's stores, no one else's."""
        if spill is None or not self.tenancy.retains_on(self.medium, tenant):
            return set()
        owner = self.tenancy.owner
        return {k for k in retained
                if owner(k) == tenant and not self._pinned(k) and spill(k)}

    def _over_quota(self, n: int, kept: Spill, tenant: str, incoming: int) -> list[BlockKey]:
        """Up to `n` evictable blocks of tenants over their quota here (`tenant`'s count
        with its `incoming` blocks), in policy order, no tenant brought below its quota;
        one walk of the policy that stops once it has them (an ARC that looks ahead may
        leave some for the later passes, never break a rule). The excess comes from the
        tenants' counts, not a scan of the slots."""
        tenancy, medium = self.tenancy, self.medium
        excess: dict[str, int] = {}
        for t in tenancy.counts:
            quota = tenancy.quotas.of(t, medium)
            if quota is not None:
                held = tenancy.held(medium, t) + (incoming if t == tenant else 0)
                if held > quota:
                    excess[t] = held - quota
        m = min(n, sum(excess.values()))
        if not m:
            return []
        taken: Counter[str] = Counter()

        def fair(k: BlockKey) -> bool:  # True: not a victim of this pass
            owner = tenancy.owner(k)
            if kept(k) or taken[owner] >= excess.get(owner, 0):
                return True
            taken[owner] += 1
            return False
        return self._evict(m, fair)

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None:
        """Success makes the keys visible to lookup; failure frees their slots and forgets them."""
        bad = [k for k in keys if k not in self._storing]
        if bad or len(set(keys)) != len(keys):
            raise KeyError(f"complete_store of keys not being stored (or repeated): {bad!r}")
        for key in keys:
            self._storing.remove(key)
            if not success:
                self.policy.remove(key)
                self._forget(key)
        if success:
            self._counts.stores += len(keys)
        else:
            self._counts.store_failures += len(keys)
            self.tenancy.left(self.medium, keys)
        self.log.record(self.medium, ChangeKind.STORED if success else ChangeKind.FAILED, keys)

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Slots of complete keys, one pin each (a key may be loaded by two requests at once)."""
        self._pin(keys, "prepare_load of keys not present and complete", "; lookup first")
        return [self._entries[key].slot for key in keys]

    def complete_load(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """One pin off each key; a failed load leaves the stored bytes as they were."""
        self._unpin(keys, "complete_load of keys with no load pin left")
        if success:
            self._counts.loads += len(keys)
        else:
            self._counts.load_failures += len(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Record hits for the policy, a prefix's tail first (its head ends the most
        recent); keys absent or still storing are ignored."""
        for key in reversed(keys):
            if key in self._entries and key not in self._storing:
                self.policy.touch(key)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop the keys that are present and unpinned; how many were dropped."""
        dropped = [key for key in dict.fromkeys(keys)
                   if key in self._entries and not self._pinned(key)]
        for key in dropped:
            self.policy.remove(key)
            self._forget(key)
        self.log.record(self.medium, ChangeKind.REMOVED, dropped)
        self.tenancy.left(self.medium, dropped)
        return len(dropped)

    def room(self, tenant: str = "", spill: Spill | None = None) -> int:
        """Slots a store of `tenant`'s could get now: free ones, those holding unpinned,
        unretained keys, and (with `spill`) those holding `tenant`'s own retained keys that
        a tier below keeps (a fetch is sized by it: no other retained block goes)."""
        room = len(self._free) + len(self._entries) - len(self._storing) - len(self._pins)
        if self.tenancy.any_retained:
            retained = self.tenancy.retained_on(self.medium)
            pinned = sum(1 for k in self._pinned_keys() if k in retained)
            room -= len(retained) - pinned - len(self._spillable(retained, tenant, spill))
        return room

    def hold(self, keys: Sequence[BlockKey]) -> None:
        """Pin complete keys against eviction (no load is counted): a fetched block waits
        for its request's admission this way. Undone by `release`."""
        self._pin(keys, "hold of keys not present and complete")

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Undo `hold`."""
        self._unpin(keys, "release of keys not held")

    def _pin(self, keys: Sequence[BlockKey], refusal: str, hint: str = "") -> None:
        """One pin more on each complete key (KeyError, nothing pinned, if any is not)."""
        bad = [k for k in keys if k not in self._entries or k in self._storing]
        if bad:
            raise KeyError(f"{refusal}: {bad!r}{hint}")
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, keys: Sequence[BlockKey], refusal: str) -> None:
        """One pin off each key (KeyError, nothing unpinned, if any has too few)."""
        bad = [k for k, n in Counter(keys).items() if self._pins.get(k, 0) < n]
        if bad:
            raise KeyError(f"{refusal}: {bad!r}")
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]

    def present(self, key: BlockKey) -> bool:
        """Whether `key` is stored and visible (a probe, not counted as a lookup)."""
        return key in self._entries and key not in self._storing

    def storing(self, key: BlockKey) -> bool:
        """Whether `key`'s copy into this tier is still on its way."""
        return key in self._storing

    def has(self, key: BlockKey, tokens: Sequence[int]) -> bool:
        """Whether `key` is stored, visible and holds these token ids: a probe among many
        candidates (a breakpoint's part of a block), not counted as a lookup."""
        entry = self._entries.get(key)
        return entry is not None and key not in self._storing and entry.tokens == tuple(tokens)

    def slot_of(self, key: BlockKey) -> int:
        """The slot a present key occupies."""
        return self._entries[key].slot

    def tokens_of(self, key: BlockKey) -> tuple[int, ...]:
        """The token ids a present key was stored with."""
        return self._entries[key].tokens

    def complete_keys(self) -> list[BlockKey]:
        """Every key stored and visible to lookup, least recently used first where the
        policy keeps an order (for writing a whole tier down at shutdown)."""
        return [k for k in self._entries if k not in self._storing]

    def _pinned(self, key: BlockKey) -> bool:
        return key in self._storing or key in self._pins

    def _pinned_keys(self) -> Iterator[BlockKey]:
        """Every pinned key once (storing ones and load pins are disjoint)."""
        yield from self._storing
        yield from self._pins

    def check_invariants(self) -> None:
        """Internal consistency, for tests: every slot is held by one key or free, once."""
        held = [entry.slot for entry in self._entries.values()]
        assert len(set(held)) == len(held), "a slot is held by two keys"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert set(held).isdisjoint(self._free), "a held slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "slots were lost or made up"
        assert self._storing <= self._entries.keys(), "a storing key has no slot"
        assert self._pins.keys() <= self._entries.keys(), "a pinned key has no slot"
        assert not self._storing & self._pins.keys(), "a key is loading before it is stored"
        assert all(n > 0 for n in self._pins.values()), "a zero pin count was kept"
        assert len(self.policy) == len(self._entries), "policy and slots disagree"
        parents = Counter(e.parent for e in self._entries.values() if e.parent is not None)
        assert parents == self._kids, "the children counted are not the entries' parents"
        assert self.tenancy.retained_on(self.medium) <= self._entries.keys(), (
            "a retained key is counted on a tier that does not hold it")
        assert all(key in self.policy for key in self._entries), "a held key is not in policy"
