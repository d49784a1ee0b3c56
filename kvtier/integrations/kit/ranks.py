"""One job's results from every tensor-parallel rank, combined into the one result the tier's
manager applies: each rank copies only its heads of a block, so a block is stored, fetched or
loaded only where every rank did it.

vLLM hands every rank the same jobs and merges the ranks' worker metadata each step; a rank's
I/O-thread results may come back in a later step than another's. `RankResults` holds each job
until all `world_size` ranks reported it, then gives it to the manager once: a block is ok only
if ok on every rank (the first failure's reason is kept); bytes, seconds and the finish time
are the largest rank's: the ranks move their slices at once, each over its own link, and the
tier (its planner, its counters) reckons in one rank's slice of a block. Pure Python, tested
without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.tier import Result


@dataclass
class _Owed:
    ranks: set[int]
    ok: list[bool]
    reasons: list[str]
    nbytes: int = 0
    seconds: float = 0.0
    finished_at: float = 0.0


@dataclass
class RankResults:
    """Results per (rank, job) in; whole jobs out, once every rank has reported them."""

    world_size: int
    _owed: dict[int, _Owed] = field(default_factory=dict)

    def add(self, rank: int, results: Iterable[Result]) -> list[Result]:
        """`rank`'s results; the jobs that every rank has now reported, combined."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"results from rank {rank} of a world of {self.world_size}")
        done: list[Result] = []
        for r in results:
            if self.world_size == 1:
                done.append(r)
                continue
            owed = self._owed.get(r.job_id)
            if owed is None:
                owed = self._owed[r.job_id] = _Owed(set(range(self.world_size)),
                                                    [True] * len(r.ok), [""] * len(r.ok))
            if rank not in owed.ranks or len(r.ok) != len(owed.ok):
                raise ValueError(f"job {r.job_id}: rank {rank} reported it twice or with "
                                 f"{len(r.ok)} blocks instead of {len(owed.ok)}")
            owed.ranks.discard(rank)
            for i, (ok, reason) in enumerate(zip(r.ok, r.reasons)):
                if not ok and owed.ok[i]:
                    owed.ok[i], owed.reasons[i] = False, reason
            owed.nbytes = max(owed.nbytes, r.nbytes)
            owed.seconds = max(owed.seconds, r.seconds)
            owed.finished_at = max(owed.finished_at, r.finished_at)
            if not owed.ranks:
                del self._owed[r.job_id]
                done.append(Result(r.job_id, tuple(owed.ok), tuple(owed.reasons), owed.nbytes,
                                   owed.seconds, owed.finished_at))
        return done

    @property
    def pending(self) -> int:
        """Jobs some rank has reported and another not yet."""
        return len(self._owed)
