"""Bookkeeping of the tiers below the device (host memory now; disk and remote later).

A tier says which block key lives in which slot, which slots an in-flight transfer pins,
and what to evict; it never touches bytes. Pure Python: no torch, testable anywhere.
`base.py` is the protocol, `policy.py` the eviction policies, `host.py` the host tier.
"""
