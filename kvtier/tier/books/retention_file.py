"""The retention deadlines of a local tier's blocks, kept beside its file so a restart keeps
them: one JSON object, key (hex) -> [tenant, deadline as Unix time], written whole to a
temporary file and renamed over the old one (a crash leaves the old one or the new one)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvtier.tier.keys import BlockKey

log = logging.getLogger(__name__)
NAME = "retention.json"


class RetentionFile:
    """Reads and writes the deadlines of one directory's tier."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / NAME

    def load(self) -> dict[BlockKey, tuple[str, float]]:
        """The deadlines saved by a previous process; a missing file is none, and an
        unreadable one is none too, logged (the blocks stay, as ordinary ones)."""
        try:
            raw = json.loads(self.path.read_text())
            return {bytes.fromhex(k): (str(v[0]), float(v[1])) for k, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
            log.warning("kvtier: %s cannot be read (%s); the blocks it names stay on disk "
                        "without their retention", self.path, e)
            return {}

    def save(self, retentions: Mapping[BlockKey, tuple[str, float]]) -> None:
        """Write every retention now in force, replacing the file whole (an OSError is
        logged: retention then lasts as long as this process)."""
        body = json.dumps({k.hex(): [t, until] for k, (t, until) in retentions.items()})
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".retention-")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("kvtier: %s cannot be written (%s); retention granted now lasts only "
                        "as long as this process", self.path, e)
