"""Who owns each block below the device, what each tenant may keep in each tier, and which
blocks a client asked to keep until a deadline (retention).

A tenant is a name the client gives with a block's store (vLLM's `cache_salt`, kvtier
serve's API key or salt; "" for none). The slot tiers (host, disk) tell the tenancy when a
block enters or leaves them, so it counts, per tenant and tier, the blocks held and
retained, and the evictions. Quotas are per tenant and tier, in blocks: a tenant over its
quota loses blocks first when a tier evicts (`over`), and a retention that would put a
tenant's retained blocks over it is refused. A retained block is never evicted before its
deadline (the host may let it go only where a tier below keeps it); an expired one is an
ordinary block again. Retention deadlines are wall-clock, so they survive a restart
(`RetentionFile`: each grant appended to a log, a snapshot now and then).
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvtier.tier.books.retention_file import RetentionFile
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import TenantCounts

OTHER = "other"  # the label of the tenants past the label cap
DEFAULT_TENANT = "default"  # the label of blocks stored without a tenant
MAX_FORMER = 1 << 16  # owners remembered of blocks no tier holds any more
# Tenants counted by name; past this, those holding nothing are folded into one aggregate
# (a client that makes up a cache_salt per request cannot grow these books without bound).
MAX_TENANTS = 4096
# Retention may pin at most this share of a tier's slots, all tenants together: the rest
# stays a cache for everyone, with or without quotas.
MAX_RETAINED_SHARE = 0.8
# Deadline-heap entries allowed past twice the claims before the stale ones (left behind by
# renewals) are dropped: the heap stays bounded by the tiers' slots, however often blocks
# are renewed.
HEAP_SLACK = 1024


class Refusal(str, enum.Enum):
    """Why a retention was not granted: a bounded set, each value a metric label."""

    DISABLED = "disabled"  # kv_retention_max_s is 0
    OVER_MAX = "over_max"  # longer than kv_retention_max_s
    QUOTA = "quota"  # the tenant's retained blocks would exceed its quota in a tier
    NOT_STORED = "not_stored"  # none of the prefix's blocks is held below the device
    FULL = "full"  # a tier would be more than MAX_RETAINED_SHARE retained
    INVALID = "invalid"  # no duration a client means (negative, NaN, not a number)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Grant:
    """What a retention request got: `seconds` granted, or the reason it was refused."""

    seconds: float = 0.0
    refused: Refusal | None = None
    blocks: int = 0  # blocks the grant covers

    def __str__(self) -> str:  # what a response carries: "3600" or "refused:quota"
        return f"refused:{self.refused.value}" if self.refused else f"{self.seconds:g}"

    @property
    def value(self) -> float | str:
        """The response's `kvtier_retention_s`: seconds granted, or "refused:<reason>"."""
        return str(self) if self.refused else self.seconds


@dataclass
class _Claim:
    """A block's owner, its retention deadline (0: none), the tiers holding it, and those
    of them its retention holds in (`kept`: not one whose retained share or the owner's
    quota was full when the block arrived)."""

    tenant: str
    until: float = 0.0
    media: set[Medium] = field(default_factory=set)
    kept: set[Medium] = field(default_factory=set)


@dataclass(frozen=True)
class Quotas:
    """Blocks each tenant may hold per tier (medium value -> blocks); a tier absent from a
    tenant's map has no quota for it."""

    default: Mapping[str, int] = field(default_factory=dict)
    named: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def of(self, tenant: str, medium: Medium) -> int | None:
        return self.named.get(tenant, self.default).get(medium.value)

    def __bool__(self) -> bool:
        return bool(self.default) or bool(self.named)


class Tenancy:
    """Owners, retention deadlines and per-tenant counts of every slot tier that shares it."""

    def __init__(self, quotas: Quotas | None = None, max_retention_s: float = 0.0,
                 file: RetentionFile | None = None,
                 clock: Callable[[], float] = time.time, erase_expired: bool = False) -> None:
        """`file`: where retention is kept across restarts (a local tier's directory): the
        deadlines a previous process saved there come back to the blocks a tier adopts.
        `erase_expired`: the keys whose retention expires are kept for `take_expired` (the
        manager erases them: kv_retention_erase)."""
        self.quotas = quotas or Quotas()
        self.erase_expired = erase_expired
        self._expired: list[BlockKey] = []
        self.max_retention_s = max_retention_s
        self.clock = clock
        self.file = file
        self._claims: dict[BlockKey, _Claim] = {}
        self._deadlines: list[tuple[float, BlockKey]] = []  # a heap, checked lazily
        # the keys under a retention, by tier holding them: what eviction passes over, so it
        # counts these instead of scanning a tier's every slot
        self._retained_on: dict[Medium, set[BlockKey]] = {}
        # What a previous process saved, bounded by the knobs in force now: a deadline past
        # kv_retention_max_s from now is cut to it (with retention off, 0: the owners come
        # back, no deadline does).
        saved = file.load() if file is not None else {}
        now = clock()
        self._saved = {k: (tenant, min(until, now + max_retention_s))
                       for k, (tenant, until) in saved.items() if until > now}
        self.counts: dict[str, TenantCounts] = {}
        self.capacity: dict[str, int] = {}  # slots per tier (medium value), as each tells
        self._past = TenantCounts()  # tenants folded away (MAX_TENANTS), reported as other
        # owners of blocks that left every tier, most recent last: a block stored again
        # without a tenant (a device block written back on eviction) is its owner's again
        self._former: OrderedDict[BlockKey, str] = OrderedDict()

    # -- what the tiers tell ------------------------------------------------------------

    def track(self, medium: Medium, num_slots: int) -> None:
        """A slot tier of `num_slots` shares these books (told once, as it is built)."""
        self.capacity[medium.value] = num_slots

    def entered(self, medium: Medium, keys: Iterable[BlockKey], tenant: str = "") -> None:
        """`keys` now have a slot on `medium`; a key new to every tier is `tenant`'s."""
        for key in keys:
            claim = self._claims.get(key)
            if claim is None:
                owner, until = self._saved.pop(key, (tenant or self._former.pop(key, ""), 0.0))
                claim = self._claims[key] = _Claim(owner)
                if until > self.clock():
                    claim.until = until
                    self._push(until, key)
            claim.media.add(medium)
            counts = self._of(claim.tenant)
            counts.held[medium.value] += 1
            if claim.until and self._admits(medium, claim.tenant, counts):
                self._keep(key, claim, medium, counts)

    def _admits(self, medium: Medium, tenant: str, counts: TenantCounts) -> bool:
        """Whether one more retained block fits `medium`: the tier's retained share and
        the tenant's quota there, checked in every tier a retained block enters (a spill
        to disk, a write-through), not only where it sat at the grant."""
        capacity = self.capacity.get(medium.value)
        if capacity is not None and (len(self._retained_on.get(medium, ())) + 1
                                     > MAX_RETAINED_SHARE * capacity):
            return False
        quota = self.quotas.of(tenant, medium)
        return quota is None or counts.retained[medium.value] + 1 <= quota

    def _keep(self, key: BlockKey, claim: _Claim, medium: Medium,
              counts: TenantCounts) -> None:
        """`key`'s retention holds on `medium` from now."""
        claim.kept.add(medium)
        counts.retained[medium.value] += 1
        self._retained_on.setdefault(medium, set()).add(key)

    def left(self, medium: Medium, keys: Iterable[BlockKey], evicted: bool = False) -> None:
        """`keys` lost their slot on `medium` (`evicted`: to make room, counted so)."""
        for key in keys:
            claim = self._claims.get(key)
            if claim is None or medium not in claim.media:
                continue
            claim.media.discard(medium)
            counts = self._of(claim.tenant)
            counts.held[medium.value] -= 1
            if medium in claim.kept:
                claim.kept.discard(medium)
                counts.retained[medium.value] -= 1
                self._retained_on[medium].discard(key)
            if evicted:
                counts.evictions[medium.value] += 1
            if not claim.media:
                del self._claims[key]
                if claim.tenant:
                    self._former[key] = claim.tenant
                    if len(self._former) > MAX_FORMER:
                        self._former.popitem(last=False)

    def hit(self, keys: Sequence[BlockKey]) -> None:
        """Blocks loaded from host for a request: a hit for each block's owner."""
        for key in keys:
            claim = self._claims.get(key)
            if claim is not None:
                self._of(claim.tenant).hits += 1

    # -- what eviction asks -------------------------------------------------------------

    def keys_of(self, tenant: str) -> list[BlockKey]:
        """Every key `tenant` owns that a tier holds, then those of its blocks no tier here
        holds any more that it still remembers (they may be in a shared store)."""
        return ([k for k, c in self._claims.items() if c.tenant == tenant and c.media]
                + [k for k, t in self._former.items() if t == tenant])

    def forget_owners(self, keys: Sequence[BlockKey]) -> None:
        """Forget who owned `keys` that no tier holds any more (they were purged: not even
        their hashes stay)."""
        for key in keys:
            self._former.pop(key, None)

    def owner(self, key: BlockKey) -> str:
        claim = self._claims.get(key)
        return claim.tenant if claim is not None else ""

    def retained(self, key: BlockKey) -> bool:
        """Whether `key` is pinned by an unexpired retention."""
        self.expire()
        claim = self._claims.get(key)
        return claim is not None and claim.until > 0.0

    def deadline(self, key: BlockKey) -> float:
        """The retention deadline of `key` (Unix time), 0.0 for none."""
        return self._claims[key].until if self.retained(key) else 0.0

    @property
    def any_retained(self) -> bool:
        self.expire()
        return bool(self._deadlines)

    def retained_on(self, medium: Medium) -> AbstractSet[BlockKey]:
        """The keys `medium` holds under an unexpired retention: as many as are retained,
        however large the tier. A live view, valid until the books next change."""
        self.expire()
        return self._retained_on.get(medium, frozenset())

    def kept_on(self, medium: Medium, key: BlockKey) -> bool:
        """Whether `key`'s retention holds on `medium` (it is retained, and the tier had
        room in its retained share and the owner's quota when the block arrived)."""
        self.expire()
        claim = self._claims.get(key)
        return claim is not None and medium in claim.kept

    def retains_on(self, medium: Medium, tenant: str) -> bool:
        """Whether `tenant` has a retained block on `medium`."""
        counts = self.counts.get(tenant)
        return counts is not None and counts.retained[medium.value] > 0

    def held(self, medium: Medium, tenant: str) -> int:
        """Blocks `tenant` holds on `medium` now."""
        counts = self.counts.get(tenant)
        return counts.held[medium.value] if counts is not None else 0

    def over(self, medium: Medium, tenant: str) -> bool:
        """Whether `tenant` holds more than its quota on `medium`."""
        quota = self.quotas.of(tenant, medium)
        return quota is not None and self.held(medium, tenant) > quota

    # -- retention ----------------------------------------------------------------------

    def retain(self, keys: Sequence[BlockKey], tenant: str, seconds: float | None) -> Grant:
        """Keep `keys` (those a tier holds) until `seconds` from now, for `tenant`: granted
        whole or refused whole, with the reason (`seconds` None, not finite or not > 0:
        invalid, and counted like any refusal)."""
        counts = self._of(tenant)
        refusal = self._refusal(keys, tenant, seconds)
        if refusal is not None:
            counts.retention_refused[refusal.value] += 1
            return Grant(refused=refusal)
        assert seconds is not None  # refused as invalid above
        until = self.clock() + seconds
        held = [k for k in dict.fromkeys(keys) if k in self._claims]
        for key in held:
            claim = self._claims[key]
            if not claim.until:  # `_refusal` counted it in every tier holding it
                owner = self._of(claim.tenant)
                for medium in claim.media:
                    self._keep(key, claim, medium, owner)
            if until > claim.until:
                claim.until = until
                self._push(until, key)
        counts.retention_granted += 1
        self._record(held)
        return Grant(seconds, blocks=len(held))

    def _refusal(self, keys: Sequence[BlockKey], tenant: str, seconds: float | None
                 ) -> Refusal | None:
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            return Refusal.INVALID
        if self.max_retention_s <= 0:
            return Refusal.DISABLED
        if seconds > self.max_retention_s:
            return Refusal.OVER_MAX
        held = [self._claims[k] for k in dict.fromkeys(keys) if k in self._claims]
        if not held:
            return Refusal.NOT_STORED
        new: Counter[str] = Counter(m.value for c in held if not c.until for m in c.media)
        counts = self._of(tenant)
        for medium, n in new.items():
            quota = self.quotas.of(tenant, Medium(medium))
            if quota is not None and counts.retained[medium] + n > quota:
                return Refusal.QUOTA
        for medium, n in new.items():
            retained = len(self._retained_on.get(Medium(medium), ()))
            if retained + n > MAX_RETAINED_SHARE * self.capacity.get(medium, 0):
                return Refusal.FULL
        return None

    def expire(self) -> None:
        """Retentions whose deadline passed end: their blocks are ordinary again."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            claim = self._claims.get(key)
            if claim is not None and claim.until == until:
                self._end(key, claim)
                if self.erase_expired:
                    self._expired.append(key)

    def take_expired(self) -> list[BlockKey]:
        """The keys whose retention expired since the last call and that no retention holds
        again (with `erase_expired`; else none)."""
        self.expire()
        expired, self._expired = self._expired, []
        return [k for k in dict.fromkeys(expired) if not self.retained(k)]

    def release_all(self) -> None:
        """End every retention now (a cache reset: what was retained is another identity's
        KV, which no request here asks for again): its blocks are ordinary ones, to be
        evicted like any other, and the file forgets them."""
        for key, claim in self._claims.items():
            if claim.until:
                self._end(key, claim)
        self._deadlines.clear()
        self._saved.clear()
        self.save()

    def _push(self, until: float, key: BlockKey) -> None:
        """`key`'s new deadline on the heap. A renewal leaves the old entry behind (`expire`
        passes over it), so past twice the claims the heap is rebuilt from the live ones."""
        heapq.heappush(self._deadlines, (until, key))
        if len(self._deadlines) > 2 * len(self._claims) + HEAP_SLACK:
            self._deadlines = [(c.until, k) for k, c in self._claims.items() if c.until]
            heapq.heapify(self._deadlines)

    def _end(self, key: BlockKey, claim: _Claim) -> None:
        """A retention ends: its block is an ordinary one again, in every tier holding it."""
        claim.until = 0.0
        self._of(claim.tenant).retained.subtract(m.value for m in claim.kept)
        for medium in claim.kept:
            self._retained_on[medium].discard(key)
        claim.kept.clear()

    def _record(self, keys: Sequence[BlockKey]) -> None:
        """The deadlines just set go to the file's log (a grant costs its own blocks); once
        the log outgrows twice what is retained, a snapshot replaces it."""
        if self.file is None:
            return
        self.file.append((k, self._claims[k].tenant, self._claims[k].until) for k in keys)
        if self.file.logged > 2 * len(self._deadlines) + HEAP_SLACK:
            self.save()

    def save(self) -> None:
        """Write every unexpired retention of a block a local tier holds to the file (none
        configured: nothing). Saved deadlines not adopted stay for a later process."""
        if self.file is None:
            return
        self.expire()
        now = self.clock()
        kept = {k: v for k, v in self._saved.items() if v[1] > now}
        kept.update((k, (c.tenant, c.until)) for k, c in self._claims.items()
                    if c.until and any(m != Medium.HOST for m in c.media))
        self.file.save(kept)

    # -- report -------------------------------------------------------------------------

    def report(self, max_labels: int) -> dict[str, TenantCounts]:
        """The counts by tenant label: the `max_labels` tenants holding most blocks by name
        (no tenant as "default"), the rest folded into "other"."""
        self.expire()
        ranked = sorted(self.counts.items(), key=lambda kv: (-sum(kv[1].held.values()),
                                                             kv[0]))
        out: dict[str, TenantCounts] = {}
        for i, (tenant, counts) in enumerate(ranked):
            label = (tenant or DEFAULT_TENANT) if i < max_labels else OTHER
            out.setdefault(label, TenantCounts()).add(counts)
        if self._past != TenantCounts():
            out.setdefault(OTHER, TenantCounts()).add(self._past)
        return out

    def counts_of(self, tenant: str) -> TenantCounts:
        """`tenant`'s counts, to add to (its prefetches: `fetch_up.py`)."""
        return self._of(tenant)

    def _of(self, tenant: str) -> TenantCounts:
        counts = self.counts.get(tenant)
        if counts is None:
            if len(self.counts) >= MAX_TENANTS:
                self._fold()
            counts = self.counts[tenant] = TenantCounts()
        return counts

    def _fold(self) -> None:
        """Tenants that hold no block now are summed into `_past` and forgotten by name."""
        for tenant in [t for t, c in self.counts.items() if not any(c.held.values())]:
            self._past.add(self.counts.pop(tenant))
