"""Bookkeeping of the tiers below the device: host memory, a disk file, a shared store.

A tier says which block key lives in which slot, which slots an in-flight transfer pins,
and what to evict; it never touches bytes. Pure Python: no torch, testable anywhere.
`base.py` is the protocol, `policy.py` the eviction policies, `slots.py` the slot tiers
(`host.py`, `disk.py`), `remote.py` the shared store (presence asked off the caller's thread).
"""
