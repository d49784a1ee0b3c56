"""`kvtier export-hf`: the exported directory loads back as the same model (same logits)."""

from pathlib import Path

import pytest
import torch

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import ModelLoadError
from kvtier.model.export import export_hf
from kvtier.model.loader import LoadedModel, load_model
from kvtier.sequence import SamplingParams


def first_logprobs(loaded: LoadedModel, prompt: list[int]) -> dict[int, float]:
    engine = LLMEngine(EngineConfig.from_knobs(model=loaded.source, num_device_blocks=16),
                       loaded=loaded)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    return engine.run_to_completion([rid])[rid].logprobs[0]


def test_exported_float32_model_loads_back_with_the_same_outputs(tiny: LoadedModel,
                                                                 tmp_path: Path) -> None:
    out = export_hf(tiny, tmp_path / "hf", dtype="float32")
    back = load_model(str(out))
    assert back.spec.describe() == tiny.spec.describe()
    assert back.tokenizer.digest() == tiny.tokenizer.digest()
    assert back.tokenizer.chat_template == tiny.tokenizer.chat_template
    for name, t in tiny.weights.items():
        assert torch.equal(back.weights[name], t), name
    prompt = tiny.tokenizer.encode("hello there, general")
    assert first_logprobs(back, prompt) == first_logprobs(tiny, prompt)


def test_export_refuses_an_existing_directory_and_leaves_nothing_half_written(
        tiny: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(ModelLoadError, match="exists already"):
        export_hf(tiny, tmp_path / "taken")
    with pytest.raises(ModelLoadError, match="dtype"):
        export_hf(tiny, tmp_path / "new", dtype="int3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
