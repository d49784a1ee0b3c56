"""One stored KV block (a disk slot or a Redis value) = a self-describing header + the payload.

Bytes that outlive the process can come back wrong: a different model wrote them, a crash
tore a write, a disk flipped a bit. The header therefore names the writer's namespace, the
block's key and token ids, the payload's size and xxh3 checksum, and carries a checksum of
its own bytes, so every such case is a miss (`CorruptBlock` or a `check` reason), never a
wrong hit served as KV.

Header, little-endian:
    magic "KVTB" | version u16 | key_len u8 | encoding_len u8 | num_tokens u16 |
    namespace 16B | payload_nbytes u64 | payload checksum u64 |
    key | encoding (ascii) | token ids u32 x num_tokens | xxh3_64 of all the above u64
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.errors import KvtierError
from kvtier.tier.fingerprint import FORMAT_VERSION

MAGIC = b"KVTB"
NAMESPACE_NBYTES = 16
MAX_KEY_NBYTES = 255
MAX_ENCODING_NBYTES = 15
MAX_TOKENS = 65535
_FIXED = struct.Struct("<4sHBBH16sQQ")
_CHECKSUM = struct.Struct("<Q")
_U64 = 2**64

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


class CorruptBlock(KvtierError):
    """Stored bytes that are not a valid block; the caller treats the block as a miss.

    `reason` is one of: "magic" (not a block header), "version" (another format version),
    "truncated" (fewer bytes than the header or payload needs), "header-checksum" (a header
    byte changed), "field" (a checksummed but impossible field), "size" (the payload length
    differs from what the header or the slot allows).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"corrupt KV block ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    """What a stored block claims to be; validated on construction (ValueError)."""

    namespace: bytes
    key: bytes
    tokens: tuple[int, ...]
    payload_nbytes: int
    checksum: int
    encoding: str = ""  # "" = exact KV bytes; else an opaque lossy-encoding tag ("int8")

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


def _token_array(tokens: Sequence[int]) -> array:
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
    return (_FIXED.size + len(h.key) + len(h.encoding) + 4 * len(h.tokens)
            + _CHECKSUM.size)


def max_header_nbytes(block_size: int) -> int:
    """Upper bound of an encoded header for `block_size` tokens (disk slots are sized by it)."""
    if not 0 <= block_size <= MAX_TOKENS:
        raise ValueError(f"block_size must be in [0, {MAX_TOKENS}], got {block_size}")
    return (_FIXED.size + MAX_KEY_NBYTES + MAX_ENCODING_NBYTES + 4 * block_size
            + _CHECKSUM.size)


def encode_header(h: BlockHeader) -> bytes:
    """The header's bytes, ending with a checksum of everything before it."""
    tokens = _token_array(h.tokens)
    if sys.byteorder == "big":
        tokens.byteswap()
    encoding = h.encoding.encode("ascii")
    body = b"".join([
        _FIXED.pack(MAGIC, FORMAT_VERSION, len(h.key), len(encoding), len(tokens),
                    h.namespace, h.payload_nbytes, h.checksum),
        h.key, encoding, tokens.tobytes(),
    ])
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(buf: Buffer) -> BlockHeader:
    """Parse the header at the start of `buf` (trailing bytes are ignored); CorruptBlock."""
    mv = as_bytes(buf)
    if len(mv) < len(MAGIC):
        raise CorruptBlock("truncated", f"{len(mv)} bytes cannot hold a block header")
    if mv[:len(MAGIC)] != MAGIC:
        raise CorruptBlock("magic", f"starts with {bytes(mv[:len(MAGIC)])!r}, not {MAGIC!r}")
    if len(mv) < _FIXED.size:
        raise CorruptBlock("truncated", f"{len(mv)} bytes, the fixed header is {_FIXED.size}")
    (_, version, key_len, enc_len, num_tokens, namespace, payload_nbytes,
     checksum) = _FIXED.unpack_from(mv)
    if version != FORMAT_VERSION:
        raise CorruptBlock("version", f"format version {version}, this is {FORMAT_VERSION}")
    end = _FIXED.size + key_len + enc_len + 4 * num_tokens
    if len(mv) < end + _CHECKSUM.size:
        raise CorruptBlock("truncated", f"{len(mv)} bytes, the header needs "
                                        f"{end + _CHECKSUM.size}")
    (stored,) = _CHECKSUM.unpack_from(mv, end)
    actual = xxhash.xxh3_64_intdigest(mv[:end])
    if stored != actual:
        raise CorruptBlock("header-checksum", f"header checksum {stored:#018x} != "
                                              f"{actual:#018x} of its bytes")
    pos = _FIXED.size
    key = bytes(mv[pos:pos + key_len])
    pos += key_len
    encoding_bytes = bytes(mv[pos:pos + enc_len])
    pos += enc_len
    tokens = array("I")
    tokens.frombytes(mv[pos:end])
    if sys.byteorder == "big":
        tokens.byteswap()
    try:
        return BlockHeader(namespace, key, tuple(tokens), payload_nbytes, checksum,
                           encoding_bytes.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptBlock("field", str(e)) from None


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
          payload: Buffer) -> str | None:
    """Why this block must not be served for (namespace, key, tokens), or None if it is good.

    Reasons: "fingerprint", "key", "tokens", "size", "checksum"; the checksum, the only
    check that reads every payload byte, is last.
    """
    if header.namespace != namespace:
        return "fingerprint"
    if header.key != key:
        return "key"
    if header.tokens != tuple(tokens):
        return "tokens"
    data = as_bytes(payload)
    if len(data) != header.payload_nbytes:
        return "size"
    if payload_checksum(data) != header.checksum:
        return "checksum"
    return None


def pack(header: BlockHeader, payload: Buffer) -> bytes:
    """Header then payload as one blob (a Redis value); ValueError if the size disagrees."""
    data = as_bytes(payload)
    if len(data) != header.payload_nbytes:
        raise ValueError(f"payload is {len(data)} bytes, the header says "
                         f"{header.payload_nbytes}")
    return b"".join([encode_header(header), data])


def unpack(blob: Buffer) -> tuple[BlockHeader, memoryview]:
    """Split a packed blob into its header and a zero-copy view of its payload (CorruptBlock)."""
    mv = as_bytes(blob)
    header = decode_header(mv)
    payload = mv[encoded_header_nbytes(header):]
    if len(payload) < header.payload_nbytes:
        raise CorruptBlock("truncated", f"payload is {len(payload)} bytes, the header says "
                                        f"{header.payload_nbytes}")
    if len(payload) > header.payload_nbytes:
        raise CorruptBlock("size", f"{len(payload) - header.payload_nbytes} bytes follow "
                                   f"the {header.payload_nbytes}-byte payload")
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
    return memoryview(arr)


def copy_into(t: torch.Tensor, data: Buffer) -> None:
    """Copy `data` into the bytes of a contiguous CPU tensor (ValueError if lengths differ)."""
    dst = tensor_bytes(t)
    src = as_bytes(data)
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} bytes do not fit a tensor of {len(dst)} bytes "
                         f"({tuple(t.shape)} {t.dtype})")
    dst[:] = src
