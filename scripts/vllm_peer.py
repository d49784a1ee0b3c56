"""One vLLM engine that answers requests read from stdin, one JSON line each, until stdin
closes: what a test needs to drive two engines at once (prefill on one, decode on the other,
in either order, one killed mid-write). Runs in the vLLM environment (`scripts/vllm_env.sh`).

    .venv-vllm/bin/python scripts/vllm_peer.py MODEL_DIR CONFIG_JSON
CONFIG_JSON: {"connector": {...kvtier's extra config} | null,
              "example_path": DIR (instead: vLLM's own ExampleConnector on that directory),
              "kv_role": "kv_both" | "kv_producer" | "kv_consumer", "blocks": 24,
              "kv_bytes_per_block": N, "max_model_len": 2048}
It prints "KVTIER_READY" once the engine is up; then, for each request line
  {"prompt": [ids], "max_tokens": 8, "kv_params": {...} | null, "salt": str | null}
one line "KVTIER_RESULT {...}": its tokens, top-5 logprobs, cached tokens, the
kv_transfer_params it ended with, and the seconds it took (or "error" for a request the
engine failed: the engine goes on). Greedy, with ignore_eos, as `vllm_driver.py`.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

MARK = "KVTIER_RESULT "
READY = "KVTIER_READY"
IDLE_STEP_S = 0.005  # between requests: how often the engine is stepped while it has work


def engine(model: str, spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    role = spec.get("kv_role", "kv_both")
    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role=role, kv_connector_extra_config=spec["connector"])
    elif spec.get("example_path") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role=role,
            kv_connector_extra_config={"shared_storage_path": spec["example_path"]})
    return LLM(model=model, enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
               block_size=128, kv_cache_memory_bytes=spec["blocks"] * spec["kv_bytes_per_block"],
               max_model_len=spec.get("max_model_len", 2048), max_num_seqs=4, seed=0,
               disable_hybrid_kv_cache_manager=True, disable_log_stats=True, **kwargs)


def answer(llm: Any, ask: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=ask.get("max_tokens", 8), temperature=0.0, logprobs=5,
                            ignore_eos=True)
    if ask.get("kv_params") is not None:
        params.extra_args = {"kv_transfer_params": ask["kv_params"]}
    prompt = TokensPrompt(prompt_token_ids=ask["prompt"])
    if ask.get("salt") is not None:
        prompt["cache_salt"] = ask["salt"]
    t = time.perf_counter()
    try:
        [r] = llm.generate([prompt], params, use_tqdm=False)
    except Exception as e:  # a request the engine failed: said, and the engine goes on
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    c = r.outputs[0]
    return {"tokens": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
            "cached": r.num_cached_tokens, "kv_transfer_params": r.kv_transfer_params,
            "seconds": time.perf_counter() - t}


def requests() -> queue.Queue[str | None]:
    """stdin's lines, read by a thread of their own (None once it closes)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def main() -> None:
    model, spec = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    llm = engine(model, spec)
    # an engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) steps only inside
    # generate: between requests it is stepped here while the connector has work on its
    # way (writes below host), as `vllm serve`'s busy loop steps it (has_pending_push_work)
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    lines = requests()
    print(READY, flush=True)
    while True:
        try:
            line = lines.get(timeout=IDLE_STEP_S)
        except queue.Empty:
            if core is not None and core.scheduler.has_requests():
                llm.llm_engine.step()
            continue
        if line is None:
            break
        print(MARK + json.dumps(answer(llm, json.loads(line))), flush=True)
    llm.llm_engine.engine_core.shutdown()  # the connector closes: its writes land first
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
