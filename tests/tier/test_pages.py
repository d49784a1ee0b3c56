"""The stores below host over pages an engine owns (`PageStore`, SGLang's way in): pages come
back byte for byte through disk, a shared directory and Redis; a damaged page is a miss and
leaves; another namespace never finds them; bad calls are refused with a clear error."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.tier import Medium, PageStore, TierConfig
from kvtier.tier.jobs import Miss, Reason

PAGE = 4096
NS, OTHER = bytes(range(16)), bytes(range(1, 17))
KEYS = [bytes.fromhex(f"{i:02x}" * 32) for i in range(1, 6)]


def pages(n: int = len(KEYS), seed: int = 0) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(PAGE))) for _ in range(n)]


def config(tmp_path: Path, kind: str, url: str = "") -> TierConfig:
    knobs: dict[str, Any] = {"kv_offloading_size": 0.01}
    if kind == "disk":
        knobs.update(disk_kv_path=str(tmp_path / "disk"), disk_kv_size=0.01,
                     disk_kv_read_gbps=1.0)
    elif kind == "fs":
        knobs.update(kv_stores={"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}})
    else:
        knobs.update(remote_kv_url=url, remote_kv_read_gbps=1.0)
    return TierConfig.of(**knobs)


@pytest.fixture(params=["disk", "fs", "redis"])
def store_config(request: Any, tmp_path: Path) -> TierConfig:
    if request.param == "redis":
        return config(tmp_path, "redis", request.getfixturevalue("redis_server").url)
    return config(tmp_path, request.param)


def test_pages_come_back_byte_for_byte(store_config: TierConfig) -> None:
    want = pages()
    a = PageStore.open(store_config, NS, PAGE)
    try:
        assert a.put(KEYS, want) == [True] * len(KEYS)
        assert a.put(KEYS[:2], want[:2]) == [True, True]  # already there: not rewritten
        written = a.counts.written
    finally:
        a.close()
    assert written == len(KEYS)
    b = PageStore.open(store_config, NS, PAGE)  # a second opening: what another process sees
    try:
        assert b.exists(KEYS) == len(KEYS)
        got = pages()
        assert b.get(KEYS, got) == [True] * len(KEYS)
        assert [bytes(g) for g in got] == [bytes(w) for w in want]
        assert b.exists([*KEYS[:2], b"\x09" * 32, KEYS[3]]) == 2
    finally:
        b.close()


def test_another_namespace_never_finds_them(store_config: TierConfig) -> None:
    a = PageStore.open(store_config, NS, PAGE)
    try:
        a.put(KEYS, pages())
    finally:
        a.close()
    b = PageStore.open(store_config, OTHER, PAGE)
    try:
        got = pages()
        assert b.exists(KEYS) == 0 and b.get(KEYS, got) == [False] * len(KEYS)
    finally:
        b.close()


def test_a_damaged_page_is_a_miss_and_leaves(tmp_path: Path) -> None:
    cfg = config(tmp_path, "fs")
    a = PageStore.open(cfg, NS, PAGE)
    try:
        a.put(KEYS, pages())
        files = sorted((tmp_path / "fs").rglob("*"))
        path = next(p for p in files if p.is_file() and p.name == KEYS[2].hex())
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 0x10
        path.write_bytes(bytes(blob))
        got = pages()
        assert a.get(KEYS, got) == [True, True, False, False, False]
        assert a.counts.misses == {Miss(Medium("fs"), Reason.CHECKSUM): 1}
        assert not path.exists()
    finally:
        a.close()


def test_bad_calls_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no store below host"):
        PageStore.open(TierConfig.of(kv_offloading_size=0.01), NS, PAGE)
    a = PageStore.open(config(tmp_path, "fs"), NS, PAGE)
    try:
        with pytest.raises(ValueError, match="a page of 10 bytes"):
            a.put(KEYS[:1], [memoryview(bytearray(10))])
        with pytest.raises(ValueError, match="keys for"):
            a.get(KEYS[:2], pages(1))
        with pytest.raises(ValueError, match="a page key"):
            a.put([b""], pages(1))
        with pytest.raises(ValueError, match="given twice"):
            a.put([KEYS[0], KEYS[0]], pages(2))
        assert a.counts.written == 0  # nothing of a refused call was written
    finally:
        a.close()
