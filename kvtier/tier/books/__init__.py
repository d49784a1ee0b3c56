"""The scheduler side of the tier: which block key lives where, what is pinned, what to evict,
and what a request is answered; it never touches bytes. Pure Python: no torch.

`manager.py` (`TierManager`) answers the engine; `below.py` walks the stores below host;
`protocol.py` is what every index implements;
`policy.py` the eviction policies, `slots.py` and `host.py` the host rows. Each store's own
index lives in its folder (`../stores/<name>/index.py`).
"""
