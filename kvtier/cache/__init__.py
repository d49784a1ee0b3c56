"""Device-side KV bookkeeping: block keys, residency, block tables, the block pool.

Pure Python: nothing here touches a tensor, so every decision is testable on any machine.
"""
