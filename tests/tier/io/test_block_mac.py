"""Blocks in a shared store are authenticated, not just checksummed: whoever can write the
Redis but lacks the secret cannot make an instance serve chosen KV, nor even see (or
delete) the blocks of a deployment with another secret. Unit checks of the format, then a
real redis-server under the wiring a client gets (build_worker_side)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from forged_block import forge, forge_all
from redis_server import RedisServer

from kvtier.errors import ConfigError
from kvtier.tier import Job, KVLayout, Medium, Reason, Result, TierConfig, build_worker_side
from kvtier.tier.builder import NO_SECRET_WARNING
from kvtier.tier.config import GIB
from kvtier.tier.io.block_format import (
    BlockHeader,
    check,
    encode_header,
    pack,
    payload_checksum,
    unpack,
)
from kvtier.tier.io.block_mac import MAC_NBYTES, BlockMac
from kvtier.tier.worker import TierWorker

NS = bytes(range(16))
SECRET = "kvtier-test-secret-" + "7" * 13  # distinctive: any leak of it is found
OTHER = "another-deployments-secret-0123"
LAYERS, SLOTS, HEADS, BS, DIM = 2, 8, 2, 4, 8
BLOCK_NBYTES = LAYERS * BS * 2 * HEADS * DIM * 4
N = 3  # blocks written, into host slots 0..2; fetched into slots 4..6
KEYS = tuple(f"block-{i}".encode() for i in range(N))
TOKENS = tuple(tuple(range(10 * i, 10 * i + BS)) for i in range(N))


# -- the format ------------------------------------------------------------------------


def signed(mac: BlockMac | None = None) -> tuple[bytes, bytes]:
    """A block of random float32 KV packed under `mac` (SECRET's by default): (blob, payload)."""
    payload = torch.randn(64, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    header = BlockHeader(NS, b"key", (1, 2, 3), len(payload), payload_checksum(payload))
    return pack(header, payload, mac or BlockMac.from_secret(SECRET.encode())), payload


def verdict(blob: bytes, mac: BlockMac | None) -> Reason | None:
    header, payload = unpack(blob)
    return check(header, namespace=NS, key=b"key", tokens=[1, 2, 3], payload=payload, mac=mac)


def test_a_signed_block_round_trips_with_its_mac() -> None:
    mac = BlockMac.from_secret(SECRET.encode())
    blob, payload = signed(mac)
    header, view = unpack(blob)
    assert len(header.mac) == MAC_NBYTES and bytes(view) == payload
    assert verdict(blob, mac) is None
    assert verdict(blob, None) is None  # its checksum is still right: readable without a MAC


def tampered(how: str, blob: bytes) -> bytes:
    header, payload = unpack(blob)
    if how == "rescaled":  # the attack: new KV, every checksum recomputed, the MAC kept
        return forge(blob)
    if how == "mac-dropped":  # ... or the MAC left out, as an instance without one writes
        return forge(blob, keep_mac=False)
    if how == "encoding":  # a header field changed, the header checksum recomputed
        return pack(replace(header, encoding="int8"), payload)
    if how == "mac-byte":
        mac = bytearray(header.mac)
        mac[0] ^= 1
        return pack(replace(header, mac=bytes(mac)), payload)
    assert how == "payload-bit"  # damage, not an attack: the checksum says so
    damaged = bytearray(blob)
    damaged[-5] ^= 0x40
    return bytes(damaged)


@pytest.mark.parametrize("how", ["rescaled", "mac-dropped", "encoding", "mac-byte"])
def test_a_block_changed_without_the_secret_is_a_mac_miss(how: str) -> None:
    mac = BlockMac.from_secret(SECRET.encode())
    blob = tampered(how, signed(mac)[0])
    assert verdict(blob, mac) is Reason.MAC
    if how in ("rescaled", "mac-dropped"):  # what the checksum alone lets through
        assert verdict(blob, None) is None


def test_damage_is_told_from_forgery_and_other_secrets_are_refused() -> None:
    mac = BlockMac.from_secret(SECRET.encode())
    blob = signed(mac)[0]
    assert verdict(tampered("payload-bit", blob), mac) is Reason.CHECKSUM
    assert verdict(blob, BlockMac.from_secret(OTHER.encode())) is Reason.MAC


def test_keys_are_derived_one_way_and_never_shown() -> None:
    a, b = BlockMac.from_secret(SECRET.encode()), BlockMac.from_secret(OTHER.encode())
    assert a.key_id != b.key_id
    assert a.store_namespace(NS) != b.store_namespace(NS) != NS
    assert len(a.store_namespace(NS)) == len(NS)
    assert a.key_id == BlockMac.from_secret(SECRET.encode()).key_id  # every instance agrees
    assert SECRET not in repr(a) and SECRET.encode() not in a.key_id
    with pytest.raises(ValueError, match="at least 16 bytes"):
        BlockMac.from_secret(b"short")
    header = unpack(signed(a)[0])[0]
    assert SECRET.encode() not in encode_header(header)


# -- knobs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("knobs", "message"), [
    ({"remote_kv_secret": "only-15-bytes!!"}, "remote_kv_secret is shorter than 16 bytes"),
    ({"remote_kv_secret": SECRET, "remote_kv_secret_file": "/s"},
     "remote_kv_secret and remote_kv_secret_file are both set"),
    ({"remote_kv_secret": SECRET, "remote_kv_url": None},
     "remote_kv_secret is set but no store that instances share"),
    ({"remote_kv_secret_file": "/s", "remote_kv_url": None},
     "remote_kv_secret_file is set but no store that instances share"),
    ({"remote_kv_secret_file": " "}, "remote_kv_secret_file is blank"),
])
def test_bad_secret_knobs_are_refused_naming_the_knob_not_the_secret(
        knobs: dict[str, Any], message: str) -> None:
    config = TierConfig.of(**{"kv_offloading_size": 0.01, "remote_kv_url": "redis://127.0.0.1:1/0",
                           **knobs})
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert message in str(err.value)
    assert SECRET not in str(err.value) and "only-15" not in str(err.value)
    assert SECRET not in repr(config) and "only-15" not in repr(config)


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot be read (No such file or directory)"),
    (b"", "is empty"),
    (b"  \n", "is empty"),
    (b"fifteen-bytes!!\n", "holds fewer than 16 bytes"),
    (b"x" * 5000, "holds more than 4096 bytes"),
])
def test_a_bad_secret_file_is_refused_naming_its_path(
        content: bytes | None, message: str, tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "kv-secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        build_worker_side(config(redis_server.url, remote_kv_secret_file=str(path)), layout(),
                          NS, BS)
    assert f"remote_kv_secret_file={str(path)!r}" in str(err.value) and message in str(err.value)
    assert "fifteen" not in str(err.value)


# -- a real Redis, through the wiring ---------------------------------------------------


def layout() -> KVLayout:
    # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]
    return KVLayout.from_contiguous(torch.zeros(SLOTS, LAYERS, BS, 2, HEADS, DIM))


def config(url: str, **knobs: Any) -> TierConfig:
    c = TierConfig.of(kv_offloading_size=SLOTS * BLOCK_NBYTES / GIB, remote_kv_url=url, **knobs)
    c.validate()
    return c


def rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(LAYERS, BS, 2, HEADS, DIM, generator=g) for _ in range(N)]


def run(w: TierWorker, job: Job) -> Result:
    w.submit(job)
    assert w.io is not None
    for _ in range(100):
        for r in w.io.wait_any(timeout=0.1):
            if r.job_id == job.id:
                return r
    raise AssertionError(f"job {job.id} did not finish")


def put(w: TierWorker, blocks: list[torch.Tensor]) -> Result:
    for slot, block in enumerate(blocks):
        w.host.tensor[slot].copy_(block)
    return run(w, Job(1, Medium.HOST, Medium.REDIS, tuple(range(N)), keys=KEYS,
                      tokens=TOKENS, media=(Medium.REDIS,) * N, below_slots=(-1,) * N))


def get(w: TierWorker) -> Result:
    w.host.tensor[4:4 + N].zero_()
    return run(w, Job(2, Medium.REDIS, Medium.HOST, tuple(range(4, 4 + N)), keys=KEYS,
                      tokens=TOKENS, media=(Medium.REDIS,) * N, below_slots=(-1,) * N))


def instance(url: str, **knobs: Any) -> TierWorker:
    return build_worker_side(config(url, **knobs), layout(), NS, BS)


def stored(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter(match=b"kvtier:*"))


def test_blocks_under_a_secret_round_trip_and_forgeries_are_mac_misses_and_deleted(
        redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret_file = tmp_path / "kv-secret"
    secret_file.write_text(SECRET + "\n")  # as `echo` writes it: the newline is not the secret
    os.chmod(secret_file, 0o600)
    blocks = rows()
    client = redis_server.client()
    with caplog.at_level(logging.DEBUG):
        writer = instance(redis_server.url, remote_kv_secret_file=str(secret_file))
        try:
            assert put(writer, blocks).ok == (True,) * N
        finally:
            writer.close()
        reader = instance(redis_server.url, remote_kv_secret=SECRET)  # the same secret inline
        try:
            got = get(reader)
            assert got.ok == (True,) * N and got.reasons == (Reason.OK,) * N
            for i, block in enumerate(blocks):
                assert torch.equal(reader.host.tensor[4 + i], block)
            assert len(stored(client)) == N
            assert forge_all(client) == N  # rescaled by 1.5, checksums recomputed
            got = get(reader)
        finally:
            reader.close()
    # every forged block of the prefix is refused and deleted in one fetch (none served)
    assert got.ok == (False,) * N
    assert got.reasons == (Reason.MAC,) * N
    assert len(stored(client)) == 0
    assert NO_SECRET_WARNING not in caplog.text
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_another_secret_finds_nothing_and_deletes_nothing(redis_server: RedisServer) -> None:
    client = redis_server.client()
    mine = instance(redis_server.url, remote_kv_secret=SECRET)
    theirs = instance(redis_server.url, remote_kv_secret=OTHER)
    unsigned = instance(redis_server.url)
    try:
        assert put(mine, rows()).ok == (True,) * N
        before = {name: client.get(name) for name in stored(client)}
        for other in (theirs, unsigned):
            got = get(other)
            assert got.ok == (False,) * N
            assert got.reasons == (Reason.MISSING, Reason.SKIPPED, Reason.SKIPPED)
        assert {name: client.get(name) for name in stored(client)} == before  # all still there
        assert get(mine).ok == (True,) * N
    finally:
        for w in (mine, theirs, unsigned):
            w.close()


def test_without_a_secret_blocks_round_trip_after_one_warning(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    blocks = rows()
    with caplog.at_level(logging.WARNING):
        w = instance(redis_server.url)
        try:
            assert put(w, blocks).ok == (True,) * N
            assert get(w).ok == (True,) * N
            for i, block in enumerate(blocks):
                assert torch.equal(w.host.tensor[4 + i], block)
        finally:
            w.close()
    warnings = [r for r in caplog.records if r.getMessage() == NO_SECRET_WARNING]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "remote_kv_secret_file" in NO_SECRET_WARNING and "chooses" in NO_SECRET_WARNING
