"""kvtier's own engine, the tier's first client: `llm_engine` (the loop), `scheduler`,
`admission` (where a sequence's KV comes from), `tier_client` (the device-pool half)."""
