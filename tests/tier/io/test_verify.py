"""One verify-and-serve step for every reader (the I/O thread and SGLang's pages): a good
block is served, a bad one is marked for discarding, a store's failure keeps the block."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.tier.io.block_format import BlockHeader, Buffer, CorruptBlock, payload_checksum
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.io.store import StoreMiss
from kvtier.tier.io.verify import read_verified
from kvtier.tier.jobs import Reason

NS, KEY, TOKENS = b"n" * 16, b"k" * 16, (1, 2, 3)
PAYLOAD = bytes(range(64))


class Reads:
    """One fetch's reads that hand back a fixed header and payload, or raise."""

    def __init__(self, header: BlockHeader | None = None, payload: Buffer = PAYLOAD,
                 error: Exception | None = None) -> None:
        self.header, self.payload, self.error = header, payload, error

    def ready(self, key: bytes) -> bool:
        return True

    def read(self, key: bytes, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        if self.error is not None:
            raise self.error
        assert self.header is not None
        return self.header, self.payload


class Store:
    def __init__(self, mac: BlockMac | None = None) -> None:
        self.mac = mac


def header(**changes: Any) -> BlockHeader:
    fields: dict[str, Any] = {"namespace": NS, "key": KEY, "tokens": TOKENS,
                              "payload_nbytes": len(PAYLOAD),
                              "checksum": payload_checksum(PAYLOAD), **changes}
    return BlockHeader(**fields)


def verdict(reads: Reads, store: Store | None = None) -> Any:
    out = memoryview(bytearray(len(PAYLOAD)))
    return read_verified(store or Store(), reads, KEY, 0, out, NS, TOKENS)  # type: ignore[arg-type]


def test_a_good_block_is_served_with_its_payload() -> None:
    v = verdict(Reads(header()))
    assert v.ok and bytes(v.payload) == PAYLOAD and not v.bad and v.failure is None


@pytest.mark.parametrize("reads, reason", [
    (Reads(header(checksum=1)), Reason.CHECKSUM),
    (Reads(header(tokens=(9,))), Reason.TOKENS),
    (Reads(header(namespace=b"o" * 16)), Reason.FINGERPRINT),
    (Reads(error=CorruptBlock(Reason.TRUNCATED, "cut")), Reason.TRUNCATED),
    (Reads(error=ValueError("a payload of another size")), Reason.SIZE),
])
def test_a_bad_block_is_marked_for_discarding(reads: Reads, reason: Reason) -> None:
    v = verdict(reads)
    assert (v.reason, v.bad, v.failure) == (reason, True, None) and not v.ok


def test_without_the_secrets_mac_a_block_is_bad() -> None:
    v = verdict(Reads(header()), Store(BlockMac.from_secret(b"s" * 32)))
    assert v.reason is Reason.MAC and v.bad


@pytest.mark.parametrize("error, reason", [(StoreMiss(Reason.MISSING, "absent"), Reason.MISSING),
                                           (StoreMiss(Reason.DEADLINE, "late"), Reason.DEADLINE),
                                           (OSError(5, "EIO"), Reason.IO)])
def test_a_store_that_fails_keeps_the_block(error: Exception, reason: Reason) -> None:
    v = verdict(Reads(error=error))
    assert (v.reason, v.bad, v.failure) == (reason, False, error)
