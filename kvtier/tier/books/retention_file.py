"""The retention deadlines of a local tier's blocks, kept beside its file so a restart keeps
them. Two files: `retention.json`, a snapshot ({"generation": N, "blocks": {key hex: [tenant,
deadline as Unix time]}}) written whole to a temporary file and renamed over the old one (a
crash leaves the old or the new one), and `retention.N.log`, one JSON line per deadline set
since snapshot N, appended (a grant costs its own blocks, not every retained block's:
rewriting 40,000 of them took 152-256 ms on the scheduler's thread). Loading replays log N
over snapshot N, so a crash just after a snapshot never replays an older log over it (a
retention a reset ended stays ended); a torn last line (a crash mid-append) is skipped. The
owner compacts (a new snapshot, a new log) once the log outgrows what is retained."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvtier.tier.keys import BlockKey

log = logging.getLogger(__name__)
NAME = "retention.json"


class RetentionFile:
    """Reads and writes the deadlines of one directory's tier."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / NAME
        self.generation = 0  # the snapshot's; its log is the one appended to
        self.logged = 0  # lines in that log

    @property
    def log_path(self) -> Path:
        return self.path.with_name(f"retention.{self.generation}.log")

    def load(self) -> dict[BlockKey, tuple[str, float]]:
        """The deadlines saved by a previous process: the snapshot, then the log over it. A
        missing file is none; an unreadable one is none too, logged (the blocks stay, as
        ordinary ones)."""
        out: dict[BlockKey, tuple[str, float]] = {}
        try:
            raw = json.loads(self.path.read_text())
            if "blocks" in raw:  # a snapshot; a bare object is one written before the log
                self.generation, raw = int(raw["generation"]), raw["blocks"]
            out = {bytes.fromhex(k): (str(v[0]), float(v[1])) for k, v in raw.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
            log.warning("kvtier: %s cannot be read (%s); the blocks it names stay on disk "
                        "without their retention", self.path, e)
        try:
            lines = self.log_path.read_text().splitlines()
        except FileNotFoundError:
            return out
        except (OSError, ValueError) as e:
            log.warning("kvtier: %s cannot be read (%s); the retentions granted since %s "
                        "was written are lost", self.log_path, e, self.path.name)
            return out
        for line in lines:
            try:
                k, tenant, until = json.loads(line)
                out[bytes.fromhex(k)] = (str(tenant), float(until))
            except (ValueError, TypeError):
                continue  # a torn line: a crash in the middle of an append
        self.logged = len(lines)
        return out

    def append(self, retentions: Iterable[tuple[BlockKey, str, float]]) -> None:
        """Add deadlines set now to the log (an OSError is logged: they then last as long as
        this process, unless a later snapshot carries them)."""
        lines = [json.dumps([k.hex(), t, until]) + "\n" for k, t, until in retentions]
        if not lines:
            return
        try:
            with open(self.log_path, "a") as f:
                f.write("".join(lines))
            self.logged += len(lines)
        except OSError as e:
            log.warning("kvtier: %s cannot be written (%s); retention granted now lasts only "
                        "as long as this process", self.log_path, e)

    def save(self, retentions: Mapping[BlockKey, tuple[str, float]]) -> None:
        """Write every retention now in force as the next snapshot, with a new, empty log
        (an OSError is logged: retention then lasts as long as this process)."""
        body = json.dumps({"generation": self.generation + 1,
                           "blocks": {k.hex(): [t, until] for k, (t, until) in
                                      retentions.items()}})
        old = self.log_path
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".retention-")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
            self.generation, self.logged = self.generation + 1, 0
            old.unlink(missing_ok=True)  # replayed over no snapshot now
        except OSError as e:
            log.warning("kvtier: %s cannot be written (%s); retention granted now lasts only "
                        "as long as this process", self.path, e)
