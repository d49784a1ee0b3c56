"""Random interleavings of the two-phase protocol against a model of what must be true."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tier.books.host import HostTier

CAPACITY = 4
KEY_IDS = st.integers(0, 7)  # 8 keys for 4 slots: eviction is frequent
BATCH = st.lists(KEY_IDS, min_size=1, max_size=4)


def k(i: int) -> bytes:
    return b"key:" + bytes([i])  # not 16 bytes on purpose: keys are opaque


class TierMachine(RuleBasedStateMachine):
    """The model: which key holds which slot, which are storing, and the load pins."""

    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(CAPACITY, self.POLICY)
        self.slot: dict[bytes, int] = {}  # every held key (storing or complete)
        self.storing: set[bytes] = set()
        self.pins: Counter[bytes] = Counter()
        self.stores: list[list[bytes]] = []  # prepared, not completed
        self.loads: list[list[bytes]] = []  # prepared, not completed

    def complete(self) -> set[bytes]:
        return set(self.slot) - self.storing

    def pinned(self, key: bytes) -> bool:
        return key in self.storing or self.pins[key] > 0

    @rule(ids=BATCH)
    def prepare_store(self, ids: list[int]) -> None:
        keys = [k(i) for i in ids]
        new = [key for key in dict.fromkeys(keys) if key not in self.slot]
        evictable = [key for key in self.complete() if not self.pinned(key) and key not in keys]
        free = CAPACITY - len(self.slot)
        result = self.tier.prepare_store(keys, [[i] for i in ids])
        if result is None:
            assert len(new) > free + len(evictable), "refused a store that could fit"
            return
        assert result.keys == new
        assert len(result.evicted) == max(0, len(new) - free)
        for key in result.evicted:
            assert key in evictable, f"evicted {key!r}: pinned, storing or in the batch"
            del self.slot[key]
        held = set(self.slot.values())
        assert len(set(result.slots)) == len(result.slots), "one slot handed out twice"
        assert held.isdisjoint(result.slots), "a held (maybe pinned) slot handed out again"
        self.slot.update(zip(result.keys, result.slots))
        self.storing.update(result.keys)
        if result.keys:
            self.stores.append(result.keys)

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 9), success=st.booleans())
    def complete_store(self, i: int, success: bool) -> None:
        keys = self.stores.pop(i % len(self.stores))
        self.tier.complete_store(keys, success)
        self.storing.difference_update(keys)
        if not success:
            for key in keys:
                del self.slot[key]

    @rule(ids=BATCH)
    def prepare_load(self, ids: list[int]) -> None:
        keys = [key for key in (k(i) for i in ids) if key in self.complete()]
        if keys:
            assert self.tier.prepare_load(keys) == [self.slot[key] for key in keys]
            self.pins.update(keys)
            self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 9), success=st.booleans())
    def complete_load(self, i: int, success: bool) -> None:
        keys = self.loads.pop(i % len(self.loads))
        self.tier.complete_load(keys, success)
        self.pins.subtract(keys)

    @rule(ids=BATCH)
    def touch(self, ids: list[int]) -> None:
        self.tier.touch([k(i) for i in ids])

    @rule(ids=BATCH)
    def remove(self, ids: list[int]) -> None:
        keys = [k(i) for i in ids]
        gone = {key for key in keys if key in self.complete() and not self.pinned(key)}
        assert self.tier.remove(keys) == len(gone)
        for key in gone:
            del self.slot[key]

    @rule(ids=BATCH)
    def lookup(self, ids: list[int]) -> None:
        keys = [k(i) for i in ids]
        complete = self.complete()
        expected = next((n for n, key in enumerate(keys) if key not in complete), len(keys))
        assert self.tier.lookup(keys, [[i] for i in ids]) == expected

    @invariant()
    def bookkeeping_holds(self) -> None:
        self.tier.check_invariants()  # unique slots, used + free == capacity, policy agrees
        stats = self.tier.stats
        assert stats.used == len(self.slot) and stats.capacity == CAPACITY
        assert stats.pinned == len({key for key in self.slot if self.pinned(key)})
        assert len(set(self.slot.values())) == len(self.slot)

    @invariant()
    def storing_keys_are_never_hits(self) -> None:
        for key in self.storing:
            assert self.tier.lookup([key]) == 0


class TierMachineARC(TierMachine):
    POLICY = "arc"


FAST = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestLRUTierMachine = TierMachine.TestCase
TestLRUTierMachine.settings = FAST
TestARCTierMachine = TierMachineARC.TestCase
TestARCTierMachine.settings = FAST
