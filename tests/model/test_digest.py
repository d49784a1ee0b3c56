"""A file's digest sees every byte, whatever its timestamps say; a copy is the same content;
the cache serves an unchanged file and never stands in the way (corrupt, unwritable)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import kvtier.model.digest as digest
from kvtier.model.loaded import weights_digest


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the times a file's bytes are read and hashed (not served by the cache)."""
    calls: list[int] = []
    real = digest._hash

    def counted(f: Any, chunk: int = digest.CHUNK) -> str:
        calls.append(1)
        return real(f, chunk)

    monkeypatch.setattr(digest, "_hash", counted)
    return calls


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files just written count as settled: the cache may keep them (see RACY_NS)."""
    monkeypatch.setattr(digest, "RACY_NS", 0)


def weights(path: Path, n: int = 3 << 20) -> Path:
    path.write_bytes(bytes(i % 251 for i in range(n)))  # 3 MiB: several reads of a small chunk
    return path


def test_a_byte_changed_in_place_with_the_mtime_restored_changes_the_digest(
        tmp_path: Path, cache_dir: Path) -> None:
    f = weights(tmp_path / "model.safetensors")
    before = digest.file_digest(f)
    st = f.stat()
    with f.open("r+b") as out:  # one byte in the middle, same size, same inode
        out.seek(st.st_size // 2)
        out.write(b"\xff")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    assert digest.file_digest(f).hex != before.hex


def test_the_cache_is_keyed_by_ctime_too(tmp_path: Path, cache_dir: Path, settled: None,
                                         hashes: list[int]) -> None:
    f = weights(tmp_path / "model.safetensors")
    before = digest.file_digest(f)  # cached: RACY_NS is 0
    st = f.stat()
    with f.open("r+b") as out:
        out.write(b"\xff")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime back; ctime moved on
    after = digest.file_digest(f)
    assert not after.cached and after.hex != before.hex and len(hashes) == 2


def test_a_copy_at_another_path_has_the_same_digest(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    a = weights(tmp_path / "a" / "model.safetensors", 1000)
    b = tmp_path / "b.safetensors"
    shutil.copyfile(a, b)
    assert digest.file_digest(a).hex == digest.file_digest(b).hex
    assert weights_digest([a]) == weights_digest([b])
    assert weights_digest([a, b]) != weights_digest([a])


def test_the_second_call_is_served_by_the_cache(tmp_path: Path, cache_dir: Path, settled: None,
                                                hashes: list[int]) -> None:
    f = weights(tmp_path / "model.safetensors")
    first, second = digest.file_digest(f), digest.file_digest(f)
    assert (first.cached, second.cached) == (False, True)
    assert first.hex == second.hex and len(hashes) == 1
    assert json.loads((cache_dir / digest.CACHE_NAME).read_text())["format"] == digest.FORMAT


def test_a_file_written_just_now_is_not_cached(tmp_path: Path, cache_dir: Path,
                                               hashes: list[int]) -> None:
    # its timestamps may not move on a change within the same clock tick: hash it again
    f = weights(tmp_path / "model.safetensors")
    digest.file_digest(f)
    assert not digest.file_digest(f).cached and len(hashes) == 2


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[]",
                                     b'{"format": "other", "files": {}}',
                                     b'{"format": "kvtier-file-digests/1 xxh3-128", "files": 3}'])
def test_a_corrupt_cache_file_is_ignored(content: bytes, tmp_path: Path, cache_dir: Path,
                                         settled: None, hashes: list[int]) -> None:
    f = weights(tmp_path / "model.safetensors", 1000)
    expected = digest.file_digest(f).hex
    (cache_dir / digest.CACHE_NAME).write_bytes(content)
    again = digest.file_digest(f)
    assert again.hex == expected and not again.cached
    assert digest.file_digest(f).cached  # rewritten whole by the second hash


def test_a_forged_entry_with_a_stale_stamp_is_not_trusted(tmp_path: Path, cache_dir: Path,
                                                          settled: None) -> None:
    f = weights(tmp_path / "model.safetensors", 1000)
    real = digest.file_digest(f).hex
    path = cache_dir / digest.CACHE_NAME
    doc = json.loads(path.read_text())
    entry = doc["files"][str(f.resolve())]
    entry["xxh3_128"], entry["stat"][1] = "0" * 32, entry["stat"][1] - 1  # an older version's
    path.write_text(json.dumps(doc))
    assert digest.file_digest(f).hex == real


def test_an_unwritable_cache_dir_is_not_an_error(tmp_path: Path, settled: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker / "kvtier"))
    f = weights(tmp_path / "model.safetensors", 1000)
    first, second = digest.file_digest(f), digest.file_digest(f)
    assert first.hex == second.hex and not second.cached
    assert sorted(tmp_path.iterdir()) == sorted([blocker, f])  # no temp file left behind


def test_the_cache_dir_follows_xdg_then_home(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.delenv("KVTIER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert digest.cache_path() == tmp_path / "xdg" / "kvtier" / digest.CACHE_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert digest.cache_path() == tmp_path / "home" / ".cache" / "kvtier" / digest.CACHE_NAME


def test_the_cache_keeps_only_the_newest_entries(tmp_path: Path, cache_dir: Path, settled: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "MAX_ENTRIES", 2)
    files = [weights(tmp_path / f"{i}.bin", 100 + i) for i in range(3)]
    for f in files:
        digest.file_digest(f)
    kept = json.loads((cache_dir / digest.CACHE_NAME).read_text())["files"]
    assert list(kept) == [str(f.resolve()) for f in files[1:]]


def test_a_second_write_through_a_shared_mmap_is_seen(tmp_path: Path, cache_dir: Path,
                                                      settled: None) -> None:
    # A writer maps the file shared and writes a page (the mtime moves: the page was clean);
    # the digest is taken and cached; the writer writes the same page again. Unsynced, that
    # page was still dirty and the stamp would not move: the cache would answer the first
    # bytes. The digest syncs the file before stamping it, so the second write faults and
    # moves the stamp.
    import mmap
    import time

    f = weights(tmp_path / "model.safetensors", 1 << 16)
    with f.open("r+b") as out, mmap.mmap(out.fileno(), 0) as mapped:
        mapped[100] = 1
        first = digest.file_digest(f)
        time.sleep(0.05)  # past a coarse clock tick
        mapped[101] = 2  # the same page
        second = digest.file_digest(f)
    assert not second.cached and second.hex != first.hex


def test_the_racy_window_is_the_kernels_writeback_window(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    # default: 30 s to expire + 5 s between flusher runs; a file 10 s old is still racy
    window = digest.racy_window_ns()
    assert window >= digest.MIN_RACY_NS
    now = 100 * 10**9
    assert digest.racy((0, now - 10**9, now - 10**9), now) == (window > 10**9)
    assert not digest.racy((0, 0, 0), now + int(min(window, 10**12)))
    monkeypatch.setattr(digest, "RACY_NS", 0)
    assert not digest.racy((0, now - 1, now - 1), now)
