"""An engine restarted on the same disk tier after one byte of its model file changed finds
nothing there (its KV came from other weights); unchanged, it restores the prefix (control)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.export import export_hf
from kvtier.model.loader import LoadedModel, load_model
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams

TIERS = {"num_device_blocks": 48, "kv_offloading_size": 0.02, "disk_kv_size": 0.01,
         "disk_kv_read_gbps": 2.0}  # a fixed read rate: the planner never waits on this disk
PROMPT = [10 + (i * 13) % 300 for i in range(100)]  # 6 full 16-token blocks
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TENSOR = "model.layers.0.self_attn.v_proj.weight"


@pytest.fixture
def model(tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "digests"))
    return export_hf(tiny, tmp_path / "tiny-hf", dtype="float32")


def serve(model: Path, disk: Path) -> RequestOutput:
    """A fresh load of the directory (as a restarted server does), one request, a clean exit."""
    loaded = load_model(str(model))
    engine = LLMEngine(EngineConfig.from_knobs(model=str(model), disk_kv_path=str(disk),
                                               **TIERS), loaded=loaded)
    try:
        rid = engine.add_request(PROMPT, PARAMS)
        return engine.run_to_completion([rid])[rid]
    finally:
        engine.close()  # writes the cache down to disk


def flip_one_weight_byte(model: Path) -> None:
    """The lowest byte of TENSOR's first float32 (a change far below any sampled window's
    notice), in place, with the mtime put back."""
    file = model / "model.safetensors"
    st = file.stat()
    with file.open("r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        start, _ = json.loads(f.read(header_len))[TENSOR]["data_offsets"]
        f.seek(8 + header_len + start)
        byte = f.read(1)[0]
        f.seek(8 + header_len + start)
        f.write(bytes([byte ^ 0x01]))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_one_changed_weight_byte_restores_nothing(model: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    assert serve(model, disk).residency == "new"
    control = serve(model, disk)  # a restart on unchanged weights finds its prefix on disk
    assert control.residency == "disk" and control.num_restored_tokens == 96
    flip_one_weight_byte(model)
    changed = serve(model, disk)
    assert changed.residency == "new" and changed.num_restored_tokens == 0
