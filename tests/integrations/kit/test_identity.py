"""The identities kvtier gives vLLM's weights and LoRA adapters change with any byte, never
with the path; no vLLM needed (the module must import without it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import kvtier.integrations.kit.identity as identity
import kvtier.model.digest as digest
from kvtier.errors import ConfigError
from kvtier.integrations.kit.identity import AdapterMemo, adapter_identity, weights_identity

V_PROJ = "model.layers.0.self_attn.v_proj.weight"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "RACY_NS", 0)  # the cache keeps what it hashed: the harder case
    return tmp_path / "cache"


def model_dir(path: Path) -> Path:
    """A two-layer model in two shards, as vLLM would load it."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    layer0 = {V_PROJ: rng.standard_normal((4, 8), dtype=np.float32),
              "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8),
                                                                            dtype=np.float32)}
    layer1 = {"model.layers.1.self_attn.v_proj.weight": rng.standard_normal((4, 8),
                                                                           dtype=np.float32)}
    safetensors.numpy.save_file(layer0, str(path / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file(layer1, str(path / "model-00002-of-00002.safetensors"))
    return path


def header(file: Path) -> bytes:
    raw = file.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


def test_the_module_imports_without_vllm() -> None:
    code = ("import sys, kvtier.integrations.kit.identity; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_tensor_scaled_and_resaved_changes_the_identity(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    shard = model / "model-00001-of-00002.safetensors"
    before, old_header = weights_identity(str(model)), header(shard)
    tensors = safetensors.numpy.load_file(str(shard))
    tensors[V_PROJ] = tensors[V_PROJ] * 4
    safetensors.numpy.save_file(tensors, str(shard))
    assert header(shard) == old_header  # what the sampled identity could not see
    assert weights_identity(str(model)) != before


def test_one_byte_changed_in_place_with_the_mtime_restored_changes_the_identity(
        tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    shard = model / "model-00002-of-00002.safetensors"
    before = weights_identity(str(model))
    st = shard.stat()
    with shard.open("r+b") as f:  # the last payload byte: far from any sampled window's start
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(model)) != before


def test_a_shard_rewritten_twice_through_a_shared_mmap_changes_the_identity(
        tmp_path: Path) -> None:
    # the second write lands on a page the first left dirty: no stamp moves by itself
    import mmap
    import time

    model = model_dir(tmp_path / "m")
    shard = model / "model-00001-of-00002.safetensors"
    with shard.open("r+b") as out, mmap.mmap(out.fileno(), 0) as mapped:
        end = len(mapped) - 1
        mapped[end] ^= 1
        first = weights_identity(str(model))
        time.sleep(0.05)
        mapped[end - 1] ^= 1
        assert weights_identity(str(model)) != first


def test_a_copy_elsewhere_is_the_same_model(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    copy = Path(shutil.copytree(model, tmp_path / "elsewhere" / "other-name"))
    assert weights_identity(str(copy)) == weights_identity(str(model))


def test_config_json_is_part_of_the_identity(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    before = weights_identity(str(model))
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 9}))
    assert weights_identity(str(model)) != before


def test_a_pin_is_returned_without_reading_the_weights(tmp_path: Path) -> None:
    assert weights_identity(str(tmp_path / "absent"), pinned="registry/v7") == "pinned:registry/v7"
    with pytest.raises(ConfigError, match="model_identity is empty"):
        weights_identity(str(tmp_path), pinned=" ")


def test_a_hub_model_is_identified_by_its_commit_only() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert weights_identity("org/model", sha) == f"org/model@{sha}"
    with pytest.raises(ConfigError, match="no commit revision pinned"):
        weights_identity("org/model")
    with pytest.raises(ConfigError, match="no commit revision pinned"):
        weights_identity("org/model", "main")


def test_a_directory_without_weight_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no weight files that vLLM's load_format=auto"):
        weights_identity(str(tmp_path))


# -- what vLLM reads, under each load_format ----------------------------------------------

def test_a_dummy_load_is_unshared_random_and_never_the_pin(tmp_path: Path) -> None:
    # load_format="dummy": vLLM never reads the files; the identity is this process's alone
    model = model_dir(tmp_path / "m")
    first = weights_identity(str(model), load_format="dummy")
    second = weights_identity(str(model), load_format="dummy")
    assert first.startswith(identity.UNSHARED) and not identity.is_shared(first)
    assert first != second  # never reused (a restart is a new call)
    assert first != weights_identity(str(model))
    pinned = weights_identity(str(model), pinned="registry/v7", load_format="dummy")
    assert not identity.is_shared(pinned)  # random weights are not the pinned model
    # one engine's scheduler and workers agree (vLLM's instance id), no other engine does
    one = weights_identity(str(model), load_format="dummy", instance="1764770000000000001")
    assert one == weights_identity(str(model), load_format="dummy",
                                   instance="1764770000000000001")
    assert one != weights_identity(str(model), load_format="dummy",
                                   instance="1764770000000000002")


def test_a_load_format_kvtier_does_not_follow_is_unshared(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    for fmt in ("tensorizer", "sharded_state", "bitsandbytes"):
        assert not identity.is_shared(weights_identity(str(model), load_format=fmt))


def test_the_files_hashed_are_the_files_vllm_reads(tmp_path: Path) -> None:
    # a directory with safetensors shards, a stale .bin and a .pt: "auto" and "safetensors"
    # read the shards (a change to the .bin is not a change); "pt" reads the .pt only
    model = model_dir(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"old bin")
    (model / "extra.pt").write_bytes(b"a pt file")
    auto = weights_identity(str(model))
    assert weights_identity(str(model), load_format="safetensors") == auto
    pt = weights_identity(str(model), load_format="pt")
    (model / "pytorch_model.bin").write_bytes(b"new bin")
    assert weights_identity(str(model)) == auto
    assert weights_identity(str(model), load_format="pt") == pt
    (model / "extra.pt").write_bytes(b"another pt")
    assert weights_identity(str(model), load_format="pt") != pt
    assert weights_identity(str(model)) == auto


def test_bin_files_are_hashed_when_there_is_no_safetensors(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"weights")
    before = weights_identity(str(model))
    (model / "pytorch_model.bin").write_bytes(b"weighTs")
    assert weights_identity(str(model)) != before


def test_a_safetensors_index_filters_the_shards_as_vllm_does(tmp_path: Path) -> None:
    # Mistral-style: shards named by the index, and a consolidated file vLLM ignores under
    # "hf" (auto picks "mistral" when consolidated*.safetensors exists: then only it counts)
    model = model_dir(tmp_path / "m")
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {V_PROJ: shards[0], "x": shards[1]}}))
    (model / "unused.safetensors").write_bytes(b"not in the index")
    hf = weights_identity(str(model), load_format="safetensors")
    (model / "unused.safetensors").write_bytes(b"changed, still not in the index")
    assert weights_identity(str(model), load_format="safetensors") == hf
    (model / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="which vLLM filters the weight files by"):
        weights_identity(str(model), load_format="safetensors")


def test_the_config_vllm_computes_with_leaves_out_where_it_was_read() -> None:
    a = json.dumps({"_name_or_path": "/mnt/a/model", "hidden_size": 8,
                    "transformers_version": "4.57.0", "text_config": {"_name_or_path": "/x"}})
    b = json.dumps({"_name_or_path": "/srv/b/copy", "hidden_size": 8,
                    "transformers_version": "4.58.1", "text_config": {"_name_or_path": "/y"}})
    assert identity.config_identity(a) == identity.config_identity(b)
    c = json.dumps({"_name_or_path": "/mnt/a/model", "hidden_size": 9})
    assert identity.config_identity(a) != identity.config_identity(c)


# -- LoRA adapters ------------------------------------------------------------------------

@dataclass
class Lora:
    """What kvtier reads of vLLM's LoRARequest."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def adapter(path: Path, scale: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["v_proj"]}))
    a = np.full((2, 8), scale, dtype=np.float32)
    b = np.full((4, 2), scale, dtype=np.float32)
    safetensors.numpy.save_file(
        {"base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": a,
         "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": b},
        str(path / "adapter_model.safetensors"))
    return path


def test_an_adapter_replaced_under_the_same_name_changes_its_identity(tmp_path: Path) -> None:
    path = adapter(tmp_path / "ad", 0.1)
    v1 = adapter_identity(Lora("ad", 1, str(path)), AdapterMemo())
    shutil.rmtree(path)
    adapter(path, 0.2)
    v2 = adapter_identity(Lora("ad", 1, str(path)), AdapterMemo())  # a new vLLM process
    assert v1 is not None and v2 is not None and v1 != v2


def test_two_deployments_adapters_of_one_name_do_not_share(tmp_path: Path) -> None:
    one = adapter_identity(Lora("default", 1, str(adapter(tmp_path / "a", 0.1))), AdapterMemo())
    two = adapter_identity(Lora("default", 1, str(adapter(tmp_path / "b", 0.3))), AdapterMemo())
    same = adapter_identity(Lora("other", 2, str(adapter(tmp_path / "c", 0.1))), AdapterMemo())
    assert one != two and one == same  # the bytes decide, neither the name nor the path


def test_an_adapter_changed_under_a_running_process_is_no_longer_cached(tmp_path: Path) -> None:
    memo = AdapterMemo()
    path = adapter(tmp_path / "ad", 0.1)
    request = Lora("ad", 1, str(path))
    first = adapter_identity(request, memo)
    assert first is not None and adapter_identity(request, memo) == first
    adapter(path, 0.2)  # vLLM may still hold the v1 weights it loaded
    assert adapter_identity(request, memo) is None
    adapter(path, 0.1)  # back to v1's bytes: still unknown which one vLLM holds
    assert adapter_identity(request, memo) is None


def test_each_request_costs_stats_not_a_hash(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    memo = AdapterMemo()
    request = Lora("ad", 1, str(adapter(tmp_path / "ad", 0.1)))
    first = adapter_identity(request, memo)
    monkeypatch.setattr(identity, "file_digest", None)  # any read of the files would fail now
    assert adapter_identity(request, memo) == first


def test_an_adapter_kvtier_cannot_see_has_no_identity(tmp_path: Path) -> None:
    assert adapter_identity(Lora("hub", 1, "org/some-adapter"), AdapterMemo()) is None
    assert adapter_identity(Lora("gone", 1, str(tmp_path / "absent")), AdapterMemo()) is None
    (tmp_path / "empty").mkdir()
    assert adapter_identity(Lora("empty", 1, str(tmp_path / "empty")), AdapterMemo()) is None
