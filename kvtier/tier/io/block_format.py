"""One stored KV block (a disk slot or a Redis value) = a self-describing header + the payload.

Bytes that outlive the process can come back wrong: a different model wrote them, a crash
tore a write, a disk flipped a bit. The header therefore names the writer's namespace, the
block's key and token ids, the payload's size and xxh3 checksum, and carries a checksum of
its own bytes, so every such case is a miss (`CorruptBlock` or a `check` reason), never a
wrong hit served as KV. A checksum stops accidents, not a writer: blocks in a shared store
also carry a MAC (`block_mac.py`) over the header's fields and the payload, keyed by a
secret only kvtier instances hold; `check` refuses a block without a valid one.

Header, little-endian:
    magic "KVTB" | version u16 | key_len u8 | encoding_len u8 | num_tokens u16 | mac_len u8 |
    namespace 16B | payload_nbytes u64 | payload checksum u64 |
    key | encoding (ascii) | token ids u32 x num_tokens | mac (mac_len bytes, 0 or 32) |
    xxh3_64 of all the above u64
The MAC covers every byte before it as encoded with mac_len 32 (`signed_fields`), then the
payload; the header checksum covers the MAC too.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from kvtier.errors import KvtierError
from kvtier.tier.fingerprint import FORMAT_VERSION
from kvtier.tier.io.block_mac import MAC_NBYTES
from kvtier.tier.jobs import Reason

if TYPE_CHECKING:
    from kvtier.tier.io.block_mac import BlockMac

MAGIC = b"KVTB"
NAMESPACE_NBYTES = 16
MAX_KEY_NBYTES = 255
MAX_ENCODING_NBYTES = 15
MAX_TOKENS = 65535
MAX_MAC_NBYTES = MAC_NBYTES
_FIXED = struct.Struct("<4sHBBHB16sQQ")
_CHECKSUM = struct.Struct("<Q")
_U64 = 2**64

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


class CorruptBlock(KvtierError):
    """Stored bytes that are not a valid block; the caller treats the block as a miss.

    `reason` is a `Reason`: MAGIC (not a block header), VERSION (another format version),
    TRUNCATED (fewer bytes than the header or payload needs), HEADER_CHECKSUM (a header
    byte changed), FIELD (a checksummed but impossible field), SIZE (the payload length
    differs from what the header or the slot allows).
    """

    def __init__(self, reason: Reason | str, detail: str) -> None:
        self.reason = Reason(reason)  # a bounded label: ValueError for anything else
        super().__init__(f"corrupt KV block ({self.reason.value}): {detail}")


@dataclass(frozen=True)
class BlockHeader:
    """What a stored block claims to be; validated on construction (ValueError)."""

    namespace: bytes
    key: bytes
    tokens: tuple[int, ...]
    payload_nbytes: int
    checksum: int
    encoding: str = ""  # "" = exact KV bytes; else an opaque lossy-encoding tag ("int8")
    mac: bytes = b""  # remote blocks under a secret: MAC_NBYTES (block_mac.py); else empty

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != NAMESPACE_NBYTES:
            raise ValueError(f"namespace must be {NAMESPACE_NBYTES} bytes, got {self.namespace!r}")
        if not isinstance(self.key, bytes) or not 1 <= len(self.key) <= MAX_KEY_NBYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_NBYTES} bytes, got {self.key!r}")
        object.__setattr__(self, "tokens", tuple(_token_array(self.tokens)))
        if not 0 <= self.payload_nbytes < _U64:
            raise ValueError(f"payload_nbytes must be in [0, 2**64), got {self.payload_nbytes}")
        if not 0 <= self.checksum < _U64:
            raise ValueError(f"checksum must be in [0, 2**64), got {self.checksum}")
        if (not isinstance(self.encoding, str) or not self.encoding.isascii()
                or len(self.encoding) > MAX_ENCODING_NBYTES):
            raise ValueError(f"encoding must be ascii of at most {MAX_ENCODING_NBYTES} "
                             f"characters, got {self.encoding!r}")
        if not isinstance(self.mac, bytes) or len(self.mac) > MAX_MAC_NBYTES:
            raise ValueError(f"mac must be at most {MAX_MAC_NBYTES} bytes, got "
                             f"{len(self.mac) if isinstance(self.mac, bytes) else self.mac!r}")


def _token_array(tokens: Sequence[int]) -> array[int]:
    """Token ids as a native uint32 array (ValueError if any is outside [0, 2**32))."""
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"a block holds at most {MAX_TOKENS} tokens, got {len(tokens)}")
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if arr.itemsize != 4:  # C unsigned int is 4 bytes on every platform torch supports
        raise RuntimeError(f"array('I') has itemsize {arr.itemsize}, expected 4")
    return arr


def encoded_header_nbytes(h: BlockHeader) -> int:
    """Length of `encode_header(h)`: where the payload starts in a packed blob."""
    return (_FIXED.size + len(h.key) + len(h.encoding) + 4 * len(h.tokens) + len(h.mac)
            + _CHECKSUM.size)


def max_header_nbytes(block_size: int) -> int:
    """Upper bound of an encoded header for `block_size` tokens (disk slots are sized by it)."""
    if not 0 <= block_size <= MAX_TOKENS:
        raise ValueError(f"block_size must be in [0, {MAX_TOKENS}], got {block_size}")
    return (_FIXED.size + MAX_KEY_NBYTES + MAX_ENCODING_NBYTES + 4 * block_size
            + MAX_MAC_NBYTES + _CHECKSUM.size)


def _fields(h: BlockHeader, mac_len: int) -> bytes:
    """The header's bytes up to its MAC: fixed part, key, encoding, token ids."""
    tokens = _token_array(h.tokens)
    if sys.byteorder == "big":
        tokens.byteswap()
    encoding = h.encoding.encode("ascii")
    return b"".join([
        _FIXED.pack(MAGIC, FORMAT_VERSION, len(h.key), len(encoding), len(tokens), mac_len,
                    h.namespace, h.payload_nbytes, h.checksum),
        h.key, encoding, tokens.tobytes(),
    ])


def signed_fields(h: BlockHeader) -> bytes:
    """What a block's MAC covers before its payload: every header field, encoded as it is
    stored with a full-length MAC (so mac_len itself is covered too)."""
    return _fields(h, MAC_NBYTES)


def encode_header(h: BlockHeader) -> bytes:
    """The header's bytes, ending with a checksum of everything before it."""
    body = _fields(h, len(h.mac)) + h.mac
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(buf: Buffer) -> BlockHeader:
    """Parse the header at the start of `buf` (trailing bytes are ignored); CorruptBlock."""
    mv = as_bytes(buf)
    if len(mv) < len(MAGIC):
        raise CorruptBlock(Reason.TRUNCATED, f"{len(mv)} bytes cannot hold a block header")
    if mv[:len(MAGIC)] != MAGIC:
        raise CorruptBlock(Reason.MAGIC, f"starts with {bytes(mv[:len(MAGIC)])!r}, not {MAGIC!r}")
    if len(mv) < _FIXED.size:
        raise CorruptBlock(Reason.TRUNCATED, f"{len(mv)} bytes, the fixed header is {_FIXED.size}")
    (_, version, key_len, enc_len, num_tokens, mac_len, namespace, payload_nbytes,
     checksum) = _FIXED.unpack_from(mv)
    if version != FORMAT_VERSION:
        raise CorruptBlock(Reason.VERSION, f"format version {version}, this is {FORMAT_VERSION}")
    tokens_end = _FIXED.size + key_len + enc_len + 4 * num_tokens
    end = tokens_end + mac_len
    if len(mv) < end + _CHECKSUM.size:
        raise CorruptBlock(Reason.TRUNCATED,
                           f"{len(mv)} bytes, the header needs {end + _CHECKSUM.size}")
    (stored,) = _CHECKSUM.unpack_from(mv, end)
    actual = xxhash.xxh3_64_intdigest(mv[:end])
    if stored != actual:
        raise CorruptBlock(Reason.HEADER_CHECKSUM,
                           f"header checksum {stored:#018x} != {actual:#018x} of its bytes")
    pos = _FIXED.size
    key = bytes(mv[pos:pos + key_len])
    pos += key_len
    encoding_bytes = bytes(mv[pos:pos + enc_len])
    pos += enc_len
    tokens = array("I")
    tokens.frombytes(mv[pos:tokens_end])
    if sys.byteorder == "big":
        tokens.byteswap()
    try:
        return BlockHeader(namespace, key, tuple(tokens), payload_nbytes, checksum,
                           encoding_bytes.decode("ascii"), bytes(mv[tokens_end:end]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptBlock(Reason.FIELD, str(e)) from None


def decode_whole_header(buf: Buffer) -> BlockHeader:
    """A header that must fill `buf` exactly: the bytes a remote value held before the payload
    that landed in its host row (CorruptBlock, SIZE where they are more than the header)."""
    header = decode_header(buf)
    if encoded_header_nbytes(header) != len(as_bytes(buf)):
        raise CorruptBlock(Reason.SIZE, f"a {len(as_bytes(buf))}-byte header where "
                                        f"{encoded_header_nbytes(header)} were written")
    return header


def as_bytes(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (ValueError otherwise), no copy."""
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("KV bytes must be a C-contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def payload_checksum(payload: Buffer) -> int:
    """xxh3_64 of the payload's bytes (bytes, memoryview or a numpy uint8 array)."""
    return xxhash.xxh3_64_intdigest(as_bytes(payload))


def check(header: BlockHeader, *, namespace: bytes, key: bytes, tokens: Sequence[int],
          payload: Buffer, mac: BlockMac | None = None) -> Reason | None:
    """Why this block must not be served for (namespace, key, tokens), or None if it is good.

    Reasons: FINGERPRINT, KEY, TOKENS, SIZE, then the one pass over the payload. Without
    `mac`: CHECKSUM. With it the MAC is that pass (a valid MAC implies the checksum its
    writer computed); only a block that fails it is checksummed too, to tell a damaged block
    (CHECKSUM) from one no holder of this secret wrote (MAC).
    """
    if header.namespace != namespace:
        return Reason.FINGERPRINT
    if header.key != key:
        return Reason.KEY
    if header.tokens != tuple(tokens):
        return Reason.TOKENS
    data = as_bytes(payload)
    if len(data) != header.payload_nbytes:
        return Reason.SIZE
    if mac is not None:
        if mac.verify(signed_fields(header), data, header.mac):
            return None
        return Reason.CHECKSUM if payload_checksum(data) != header.checksum else Reason.MAC
    if payload_checksum(data) != header.checksum:
        return Reason.CHECKSUM
    return None


def pack(header: BlockHeader, payload: Buffer, mac: BlockMac | None = None) -> bytes:
    """Header then payload as one blob (a Redis value), the header signed with `mac` if
    given; ValueError if the size disagrees."""
    data = as_bytes(payload)
    if len(data) != header.payload_nbytes:
        raise ValueError(f"payload is {len(data)} bytes, the header says "
                         f"{header.payload_nbytes}")
    if mac is not None:
        header = replace(header, mac=mac.sign(signed_fields(header), data))
    return b"".join([encode_header(header), data])


def unpack(blob: Buffer) -> tuple[BlockHeader, memoryview]:
    """Split a packed blob into its header and a zero-copy view of its payload (CorruptBlock)."""
    mv = as_bytes(blob)
    header = decode_header(mv)
    payload = mv[encoded_header_nbytes(header):]
    if len(payload) < header.payload_nbytes:
        raise CorruptBlock(Reason.TRUNCATED, f"payload is {len(payload)} bytes, the header "
                                             f"says {header.payload_nbytes}")
    if len(payload) > header.payload_nbytes:
        raise CorruptBlock(Reason.SIZE, f"{len(payload) - header.payload_nbytes} bytes "
                                        f"follow the {header.payload_nbytes}-byte payload")
    return header, payload


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable uint8 view of a contiguous CPU tensor's bytes (any dtype), no copy."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor (call .contiguous() first)")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    arr: np.ndarray = flat.numpy()  # shares memory with `t`, and keeps it alive
    return arr.data


def copy_into(t: torch.Tensor, data: Buffer) -> None:
    """Copy `data` into the bytes of a contiguous CPU tensor (ValueError if lengths differ)."""
    dst = tensor_bytes(t)
    src = as_bytes(data)
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} bytes do not fit a tensor of {len(dst)} bytes "
                         f"({tuple(t.shape)} {t.dtype})")
    dst[:] = src
