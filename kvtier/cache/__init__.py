"""Device-side KV bookkeeping: the block pool and its prefix index, block tables, prefix hits
(block keys are the tier's: `kvtier.tier.hash_blocks`).

Pure Python: nothing here touches a tensor, so every decision is testable on any machine.
"""
