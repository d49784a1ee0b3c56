"""A store that lives outside kvtier, loaded by module path: `kv_stores={"sqlite_store:SQLITE":
{"path": FILE}}` (tests/ on the import path). One SQLite file that several processes share,
a block one row (header then payload, as `block_format.pack` lays it out, signed under the
deployment's secret). It proves a store needs no line in kvtier: its kind, its knobs, its
bytes and its books are all here, and every tier (the planner, retention, the counters)
takes it as it takes kvtier's own."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.io.block_format import BlockHeader, Buffer, CorruptBlock, decode_whole_header, pack
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.io.store import DeadlineReads, StoreMiss
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.knobs import parse_store_knobs

READ_GBPS = 0.5  # what the planner starts from; refined by every fetch


@dataclass(frozen=True)
class SqliteKnobs:
    path: str | None = None  # the database file the instances share
    write_delay_s: float = 0.0  # each write waits this long first: a far store's stand-in


class SqliteBlocks:
    """Blocks as rows of one table, keyed by namespace and key."""

    parallel_reads = False  # one connection, one lock

    def __init__(self, path: Path, namespace: bytes, medium: Medium, mac: BlockMac | None,
                 write_delay_s: float = 0.0) -> None:
        self.namespace, self.medium, self.mac = namespace, medium, mac
        self.write_delay_s = write_delay_s
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False,
                                   isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS blocks (ns BLOB, key BLOB, "
                             "value BLOB, PRIMARY KEY (ns, key))")

    def exists_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [self._db.execute("SELECT 1 FROM blocks WHERE ns=? AND key=?",
                                     (self.namespace, bytes(k))).fetchone() is not None
                    for k in keys]

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview], keep_until: Sequence[float] = ()
              ) -> list[OSError | StoreMiss | None]:
        rows = [(self.namespace, bytes(h.key), pack(h, p, self.mac))
                for h, p in zip(headers, payloads)]
        time.sleep(self.write_delay_s)
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", rows)
        return [None] * len(rows)

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        return [None] * len(keys)  # nothing here expires by itself

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> DeadlineReads:
        return DeadlineReads(lambda key, slot, out: self.read(key, out), deadline)

    def read(self, key: BlockKey, out: memoryview) -> tuple[BlockHeader, Buffer]:
        with self._lock:
            row = self._db.execute("SELECT value FROM blocks WHERE ns=? AND key=?",
                                   (self.namespace, bytes(key))).fetchone()
        if row is None:
            raise StoreMiss(Reason.MISSING, "absent")
        value = memoryview(row[0])
        extra = len(value) - len(out)
        if extra <= 0:
            raise CorruptBlock(Reason.SIZE, f"a {len(value)}-byte value where a block is "
                                            f"{len(out)} bytes and a header")
        out[:] = value[extra:]
        return decode_whole_header(value[:extra]), out

    def discard(self, key: BlockKey, slot: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM blocks WHERE ns=? AND key=?",
                             (self.namespace, bytes(key)))

    def flush(self) -> None:
        """Every write was committed when it returned."""

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def describe(self) -> dict[str, Any]:
        return {"blocks": self.count()}

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])


class SqliteKind:
    """The kind kvtier's registry loads by module path."""

    name = "sqlite"
    medium = Medium.declare("sqlite", shared=True)
    shared = True
    knobs_type = SqliteKnobs
    aliases: Mapping[str, str] = {}

    def parse(self, raw: Mapping[str, Any]) -> SqliteKnobs:
        knobs, _ = parse_store_knobs(SqliteKnobs, self.name, raw, self.aliases)
        if not knobs.path:
            raise ConfigError("the sqlite store needs 'path': the database file")
        return knobs

    def state_dir(self, knobs: SqliteKnobs) -> str | None:
        return None

    def rank_share(self, knobs: SqliteKnobs, rank: int, world_size: int) -> Mapping[str, Any]:
        return asdict(knobs)

    def open_bytes(self, site: StoreSite, knobs: SqliteKnobs) -> SqliteBlocks:
        namespace = site.mac.store_namespace(site.namespace) if site.mac else site.namespace
        blocks = SqliteBlocks(Path(str(knobs.path)), namespace, self.medium, site.mac,
                              knobs.write_delay_s)
        site.undo.callback(blocks.close)
        return blocks

    def open_both(self, site: StoreSite, knobs: SqliteKnobs) -> Opened:
        blocks = self.open_bytes(site, knobs)
        return Opened(blocks, site.presence_books(blocks.exists_many, self.medium), READ_GBPS)

    def open_books(self, site: StoreSite, knobs: SqliteKnobs) -> tuple[SecondaryIndex, float]:
        blocks = self.open_bytes(site, knobs)
        return site.presence_books(blocks.exists_many, self.medium), READ_GBPS


SQLITE = SqliteKind()
