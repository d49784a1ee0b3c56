"""Host memory <-> the tiers below it: the I/O thread (`thread.py`, `TierIO`), the protocol
every store implements (`store.py`), and what every store shares: the block format with its
checksums (`block_format.py`) and the MAC that authenticates shared blocks (`block_mac.py`)."""
