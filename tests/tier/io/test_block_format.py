"""The stored-block format: exact round trips, and every damaged byte is a miss, never a hit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tier.fingerprint import FORMAT_VERSION, Fingerprint
from kvtier.tier.io.block_format import (
    BlockHeader,
    CorruptBlock,
    check,
    copy_into,
    decode_header,
    decode_whole_header,
    encode_header,
    encoded_header_nbytes,
    max_header_nbytes,
    pack,
    payload_checksum,
    tensor_bytes,
    unpack,
)
from kvtier.tier.jobs import Reason

NS = Fingerprint("w" * 64, "llama", "float32", 16, "t" * 64).namespace()

keys = st.binary(min_size=1, max_size=255)
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=300)
payloads = st.binary(max_size=4096)
encodings = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=15)


def header_for(key: bytes, tokens: list[int], payload: bytes, encoding: str = "",
               namespace: bytes = NS) -> BlockHeader:
    return BlockHeader(namespace, key, tuple(tokens), len(payload), payload_checksum(payload),
                       encoding)


def refused(blob: bytes, key: bytes, tokens: list[int]) -> str:
    """Why a (possibly damaged) packed blob is not served: a CorruptBlock or check reason."""
    try:
        header, payload = unpack(blob)
    except CorruptBlock as e:
        return e.reason
    reason = check(header, namespace=NS, key=key, tokens=tokens, payload=payload)
    assert reason is not None, "a damaged block passed every check"
    return reason


@settings(max_examples=60, deadline=None)
@given(keys, token_lists, payloads, encodings)
def test_header_and_blob_round_trip(key: bytes, tokens: list[int], payload: bytes,
                                    encoding: str) -> None:
    h = header_for(key, tokens, payload, encoding)
    encoded = encode_header(h)
    assert len(encoded) == encoded_header_nbytes(h) <= max_header_nbytes(len(tokens))
    assert encoded[:4] == b"KVTB"
    assert decode_header(encoded) == h
    assert decode_header(encoded + b"trailing slot bytes") == h  # a disk slot's header area
    back, view = unpack(pack(h, payload))
    assert back == h and bytes(view) == payload
    assert check(back, namespace=NS, key=key, tokens=tokens, payload=view) is None


@settings(max_examples=15, deadline=None)
@given(keys, st.lists(st.integers(0, 2**32 - 1), max_size=24), encodings)
def test_every_single_byte_flip_in_a_header_is_refused(key: bytes, tokens: list[int],
                                                      encoding: str) -> None:
    payload = bytes(range(200))
    blob = pack(header_for(key, tokens, payload, encoding), payload)
    header_len = len(blob) - len(payload)
    for pos in range(header_len):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(blob)
            damaged[pos] ^= mask
            refused(bytes(damaged), key, tokens)  # asserts it is refused


def test_payload_flips_are_checksum_failures() -> None:
    payload = np.arange(512, dtype=np.uint8).tobytes()
    tokens = [7, 8, 9]
    blob = pack(header_for(b"k" * 16, tokens, payload), payload)
    header_len = len(blob) - len(payload)
    for pos in range(header_len, len(blob), 7):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        assert refused(bytes(damaged), b"k" * 16, tokens) == "checksum"


def test_a_header_flip_is_named_by_what_it_hit() -> None:
    payload = b"x" * 64
    encoded = encode_header(header_for(b"key", [1, 2], payload))
    for pos, reason in ((0, "magic"), (4, "version"), (20, "header-checksum"),
                        (len(encoded) - 1, "header-checksum")):
        damaged = bytearray(encoded)
        damaged[pos] ^= 0x01
        with pytest.raises(CorruptBlock) as err:
            decode_header(bytes(damaged))
        assert err.value.reason == reason
        assert reason in str(err.value)


def test_wrong_namespace_key_tokens_and_size_have_their_reasons() -> None:
    payload = b"kv" * 100
    h = header_for(b"key", [1, 2, 3], payload)
    other_ns = Fingerprint("v" * 64, "llama", "float32", 16, "t" * 64).namespace()
    good = {"namespace": NS, "key": b"key", "tokens": [1, 2, 3], "payload": payload}
    assert check(h, **good) is None
    assert check(h, **{**good, "namespace": other_ns}) == "fingerprint"
    assert check(h, **{**good, "key": b"kez"}) == "key"
    assert check(h, **{**good, "tokens": [1, 2, 4]}) == "tokens"
    assert check(h, **{**good, "tokens": [1, 2]}) == "tokens"
    assert check(h, **{**good, "payload": payload[:-1]}) == "size"
    # the cheap checks come first: a wrong namespace is reported even if the bytes differ too
    assert check(h, **{**good, "namespace": other_ns, "payload": b"?"}) == "fingerprint"


@pytest.mark.parametrize("cut", [0, 3, 10, 41, 60])
def test_truncated_headers_are_refused(cut: int) -> None:
    encoded = encode_header(header_for(b"key", list(range(16)), b"p"))
    with pytest.raises(CorruptBlock) as err:
        decode_header(encoded[:cut])
    assert err.value.reason == "truncated"


def test_truncated_or_padded_blobs_are_refused() -> None:
    payload = bytes(1000)
    blob = pack(header_for(b"key", [5], payload), payload)
    for cut, reason in ((1, "truncated"), (999, "truncated"), (len(blob) - 3, "truncated")):
        with pytest.raises(CorruptBlock) as err:
            unpack(blob[:-cut])
        assert err.value.reason == reason
    with pytest.raises(CorruptBlock) as err:
        unpack(blob + b"\0")
    assert err.value.reason == "size"


def test_other_format_version_and_garbage_are_refused() -> None:
    with pytest.raises(CorruptBlock) as err:
        decode_header(bytes(4096))  # a never-written disk slot
    assert err.value.reason == "magic"
    encoded = bytearray(encode_header(header_for(b"key", [1], b"p")))
    encoded[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(CorruptBlock) as err:
        decode_header(bytes(encoded))
    assert err.value.reason == "version"


def test_largest_header_fits_its_bound() -> None:
    tokens = [2**32 - 1] * 65535
    h = BlockHeader(NS, b"k" * 255, tuple(tokens), 0, payload_checksum(b""), "e" * 15,
                    b"m" * 32)  # the longest key, encoding, token ids and MAC
    encoded = encode_header(h)
    assert len(encoded) == max_header_nbytes(65535)
    assert decode_header(encoded) == h
    assert max_header_nbytes(16) < 4096  # a 16-token block's header fits in one page


@pytest.mark.parametrize("kwargs, match", [
    ({"namespace": b"short"}, "namespace must be 16 bytes"),
    ({"key": b""}, "key must be 1..255 bytes"),
    ({"key": b"k" * 256}, "key must be 1..255 bytes"),
    ({"tokens": (-1,)}, r"token ids must be integers in \[0, 2\*\*32\)"),
    ({"tokens": (2**32,)}, r"token ids must be integers in \[0, 2\*\*32\)"),
    ({"tokens": (0,) * 65536}, "at most 65535 tokens"),
    ({"payload_nbytes": -1}, "payload_nbytes"),
    ({"checksum": 2**64}, "checksum"),
    ({"encoding": "int8-but-too-long"}, "at most 15"),
    ({"encoding": "fp8\u00e9"}, "ascii"),
])
def test_invalid_headers_are_rejected_with_the_field(kwargs: dict, match: str) -> None:
    fields = {"namespace": NS, "key": b"k", "tokens": (1,), "payload_nbytes": 1,
              "checksum": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        BlockHeader(**fields)


def test_checksum_accepts_bytes_memoryview_and_numpy() -> None:
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    assert payload_checksum(data) == payload_checksum(memoryview(data)) == expected
    assert payload_checksum(data.tobytes()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_tensor_bytes_is_a_zero_copy_view_and_copy_into_restores(dtype: torch.dtype) -> None:
    # a host row: [num_layers, block_size, 2, num_kv_heads, head_dim]
    row = torch.randn(2, 4, 2, 3, 8).to(dtype)
    nbytes = row.numel() * row.element_size()
    view = tensor_bytes(row)
    assert len(view) == nbytes and not view.readonly
    assert np.frombuffer(view, np.uint8).ctypes.data == row.data_ptr()  # the same memory
    assert bytes(view) == ctypes.string_at(row.data_ptr(), nbytes)
    other = torch.zeros_like(row)
    copy_into(other, view)
    assert torch.equal(other, row)
    header = header_for(b"k", [1], bytes(view))
    assert check(header, namespace=NS, key=b"k", tokens=[1], payload=tensor_bytes(other)) is None


def test_tensor_helpers_refuse_what_they_cannot_view() -> None:
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(t.t())
    with pytest.raises(ValueError, match="do not fit a tensor of 64 bytes"):
        copy_into(t, bytes(63))
    with pytest.raises(ValueError, match="header says"):
        pack(header_for(b"k", [], b"abc"), b"abcd")


def test_a_landed_header_must_fill_its_bytes_exactly() -> None:
    h = header_for(b"k", [1, 2, 3], b"payload")
    raw = encode_header(h)
    assert decode_whole_header(raw) == h
    with pytest.raises(CorruptBlock) as e:
        decode_whole_header(raw + b"\0" * 4)  # stray bytes before the payload
    assert e.value.reason is Reason.SIZE
    with pytest.raises(CorruptBlock) as e:
        decode_whole_header(raw[:-3])
    assert e.value.reason is Reason.TRUNCATED
