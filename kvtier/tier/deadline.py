"""How long a fetch below host may take before what has not landed is recomputed.

    budget_s = min(fetch_deadline_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * predicted_s))

`predicted_s` is the planner's `fetch_s` for the hop, decided when the fetch was; the factor
leaves a healthy store room for jitter, the floor keeps a tiny fetch from being cut by a
scheduler hiccup, and `fetch_deadline_s` (a `TierConfig` knob) is the hard cap an operator
promises: no wake waits longer on disk or Redis. The budget travels in the `Job` (relative
seconds: under vLLM the job crosses a process boundary) and the clock starts when the
worker's I/O receives it, so time queued behind a write counts. A fetch is never asked to
bring more than the cap allows at the predicted rate (`Planner.blocks_within`), so a miss
means the store was slower than predicted, not that the fetch was too large.
"""

from __future__ import annotations

DEADLINE_FACTOR = 4.0  # a fetch may take this many times its prediction ...
DEADLINE_FLOOR_S = 0.5  # ... and at least this long (the remote tier's socket timeout) ...
FETCH_DEADLINE_S = 2.0  # ... but never longer than the cap (`fetch_deadline_s`'s default)


def fetch_budget_s(predicted_s: float | None, cap_s: float = FETCH_DEADLINE_S) -> float:
    """Seconds a fetch predicted to take `predicted_s` may take (None: no prediction, the
    cap); the cap wins over the floor when an operator sets it lower."""
    if predicted_s is None:
        return cap_s
    return min(cap_s, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * predicted_s))

