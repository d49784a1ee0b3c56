"""Runs one scenario against real vLLM (in the vLLM environment, `scripts/vllm_env.sh`) and
prints one JSON line: the tokens, logprobs, cached tokens and kvtier's transfer params of
each request. The connector's tests (tests/integrations) and benchmark run it as a subprocess.

    .venv-vllm/bin/python scripts/vllm_driver.py MODEL_DIR CONFIG_JSON|@FILE
CONFIG_JSON: {"connector": {...extra config} | null, "blocks": 48, "policy": "recompute",
              "prompts": [[ids] | {"after": i, "extra": [ids]}, ...] (a follow-up to prompt
              i: it, its output, then extra), "max_tokens": 8, "dtype": "float32",
              "concurrent": [[ids], ...] (sent at once, before "prompts"), "max_num_seqs": 4,
              "salts": [str | null, ...] (a cache_salt per prompt),
              "wait_until": {"i": [j, s]} (before prompt i: sleep until s seconds after
              prompt j came back; the result of i says "late": true if that had passed),
              "kv_params": [{...} | null, ...] (a kv_transfer_params per prompt, as vLLM's
              OpenAI server passes a request body's: SamplingParams.extra_args),
              "kv_hints": [{"protocol_version", "message_id", "actions": [{"action_id",
              "action_type", "action_version", "payload"}]} | null, ...] (vLLM's typed KV
              hints per prompt, `Request.kv_hints`: added through the engine, not generate),
              "kv_bytes_per_block": N (per worker rank), "metrics": true,
              "tensor_parallel_size": 1,
              "hybrid": false (true: vLLM decides on its hybrid KV allocator),
              "lora": {"name": "ad", "path": DIR} (optional: LoRA on, every prompt with it),
              "kv_events": true (vLLM publishes KV events to a subscriber here: every event
              it received, in order, is in the result's "kv_events"),
              "cold_before": [i, ...], "cold_path": DIR (before prompt i: wait for the writes
              below host to land, then drop every file under DIR from the page cache: a disk
              read that comes from the device, not from memory),
              "load_format": "auto" (vLLM's; "dummy": random weights),
              "reload_before": {"i": DIR} (before prompt i: vLLM reloads its weights in place
              from DIR, as an RL weight sync does; then, with "reset": true, resets its prefix
              cache and the connector's: the result's "resets" says what each reset returned;
              with "identity_file": PATH, "identity_before": {"i": TEXT} writes TEXT, the
              version the reload loads, into the connector's model_identity_file first),
              "abort_wakes": [i, ...] (prompt i is added, stepped until kvtier has started
              its fetch below host, then aborted; with VLLM_ENABLE_V1_MULTIPROCESSING=0 the
              result's "pinned" says what kvtier's host tier still pins at the end)}
Metrics with labels beyond vLLM's own are keyed name{label=value,...}.
float32 by default: bfloat16 is fast on vLLM CPU only with AVX-512 BF16 or AMX, which a
2-core cloud VM may lack (this one has AVX2 only: a 1000-token bf16 prefill took 13 s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MARK = "KVTIER_RESULT "  # vLLM logs to stdout too: the result is the line with this mark


class KVEventListener:
    """A ZMQ subscriber to vLLM's KV events. vLLM binds an endpoint with '*' in it and
    connects to any other, and a publisher that connects learns of a subscriber late, dropping
    its first batches: so vLLM binds a free port (all interfaces, as `tcp://*:5557` does) and
    this socket connects to it on loopback first (ZMQ retries until vLLM binds). Batches wait
    in ZMQ's queue until `drain` decodes them."""

    def __init__(self) -> None:
        import socket

        import zmq

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.endpoint = f"tcp://*:{port}"  # what vLLM's publisher binds
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)  # keep every batch until drained
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def drain(self, quiet_s: float = 1.0) -> list[dict]:
        """Every event received, oldest first, as plain values ("type" names its class),
        once none has come for `quiet_s`."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[dict] = []
        while self.socket.poll(int(quiet_s * 1000)):
            _topic, _seq, payload = self.socket.recv_multipart()
            events += msgspec.to_builtins(decoder.decode(payload).events, enc_hook=repr)
        self.socket.close(linger=0)
        return events


def drop_page_cache(llm: Any, directory: str) -> None:
    """Let the connector's write-on land (`settle`), then have the kernel forget every page
    of the files under `directory` (the benchmarks' own `drop_cache`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from disk_layout import drop_cache

    settle(llm)
    drop_cache([path for path in Path(directory).rglob("*") if path.is_file()])


def _connector(llm: Any) -> Any:
    """The scheduler's connector, where the engine core runs in this process (else None)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return None if core is None else core.scheduler.connector


def settle(llm: Any, limit_s: float = 60.0, otherwise_s: float = 1.5) -> None:
    """Step the engine while kvtier has jobs below host, as `vllm serve`'s busy loop does
    (`has_pending_push_work`): `LLM.generate` stops stepping when its requests finish, so a
    write that lands later would never be counted. An engine core in another process steps
    by itself: there, wait `otherwise_s`."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        time.sleep(otherwise_s)
        return
    deadline = time.monotonic() + limit_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.005)


def with_kv_hints(llm: Any, request_id: str, prompt: Any, params: Any,
                  envelope: dict[str, Any], lora: Any) -> Any:
    """One request with vLLM's typed KV hints (`LLM.generate` has no way to pass them: the
    engine's `add_request` does), stepped until it finishes; its RequestOutput."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    hints = KvHintsEnvelope(protocol_version=envelope["protocol_version"],
                            message_id=envelope["message_id"],
                            actions=[KvHintAction(**a) for a in envelope["actions"]])
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params, lora_request=lora, kv_hints=hints)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                done = out
    assert done is not None, "the hinted request never finished"
    return done


def abort_wake(llm: Any, request_id: str, ids: list[int], params: Any) -> dict[str, Any]:
    """Add a request beside one that keeps decoding (so no step waits for fetches: the
    fetch's result comes back steps later), step until kvtier has started its fetch below
    host (or 3 steps), then abort it, as a client that gives up on a slow wake does."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    busy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id + "-busy", TokensPrompt(prompt_token_ids=[7] * 16), busy)
    engine.step()  # the busy request is running
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
    connector = _connector(llm)
    for _ in range(3):
        engine.step()
        if connector is not None and connector.tier.manager.below.jobs:
            break
    fetching = connector is not None and bool(connector.tier.manager.below.jobs)
    engine.abort_request([request_id])
    while engine.has_unfinished_requests():
        engine.step()
    return {"aborted": True, "fetch_in_flight": fetching}


def host_pins(llm: Any) -> dict[str, Any] | None:
    """What kvtier's host tier pins once every job has landed (None: the engine core runs in
    another process)."""
    connector = _connector(llm)
    if connector is None:
        return None
    manager = connector.tier.manager
    for _ in range(200):  # let the fetches land and their results come back
        if not manager.busy:
            break
        llm.llm_engine.step()
        time.sleep(0.01)
    return {"pinned": manager.host.stats.pinned,
            "for_requests": manager.below.pinned_for_requests, "busy": manager.busy}


def main() -> None:
    model, arg = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # read at torch's import, which a
        import torch._dynamo.config  # zygote did before this run's environment was set

        torch._dynamo.config.disable = True
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    block_size = spec.get("block_size", 128)
    kv_bytes_per_block = spec["kv_bytes_per_block"]
    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy=spec.get("policy", "recompute"))
    listener = KVEventListener() if spec.get("kv_events") else None
    if listener is not None:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True,
                                                    publisher="zmq", endpoint=listener.endpoint)
    lora = None
    if spec.get("lora") is not None:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(spec["lora"]["name"], 1, spec["lora"]["path"])
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=spec["lora"].get("rank", 8))
    start = time.perf_counter()
    llm = LLM(model=model, enforce_eager=True, skip_tokenizer_init=True,
              dtype=spec.get("dtype", "float32"),
              block_size=block_size, kv_cache_memory_bytes=spec["blocks"] * kv_bytes_per_block,
              max_model_len=spec.get("max_model_len", 2048),
              max_num_seqs=spec.get("max_num_seqs", 4), seed=0,
              disable_hybrid_kv_cache_manager=None if spec.get("hybrid") else True,
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              load_format=spec.get("load_format", "auto"),
              disable_log_stats=not spec.get("metrics", False), **kwargs)
    started = time.perf_counter() - start
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, logprobs=5,
                            ignore_eos=True)
    together = []  # "concurrent": prompts sent at once (vLLM batches and preempts them)
    if spec.get("concurrent"):
        done = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["concurrent"]],
                            params, use_tqdm=False)
        together = [{"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens}
                    for r in done]
    out = []
    salts = spec.get("salts") or [None] * len(spec["prompts"])  # per prompt: a cache_salt
    sent: list[list[int]] = []  # each prompt as sent, for {"after": i} follow-ups
    cold = set(spec.get("cold_before", []))
    idle = set(spec.get("idle_before", []))  # prompts sent after an idle gap
    reloads = {int(i): path for i, path in spec.get("reload_before", {}).items()}
    resets = []
    for n, (entry, salt) in enumerate(zip(spec["prompts"], salts)):
        if n in cold:
            drop_page_cache(llm, spec["cold_path"])
        elif n in idle:
            time.sleep(spec["idle_s"])
        late = None
        if str(n) in spec.get("wait_until", {}):
            j, after_s = spec["wait_until"][str(n)]
            wait = out[j]["sent_at"] + out[j]["seconds"] + after_s - time.perf_counter()
            late = wait < 0
            time.sleep(max(0.0, wait))
        if n in reloads:  # new weights in the running engine, then (maybe) the cache reset
            if str(n) in spec.get("identity_before", {}):  # the sync names its version
                Path(spec["identity_file"]).write_text(spec["identity_before"][str(n)])
            llm.collective_rpc("reload_weights", kwargs={"weights_path": reloads[n]})
            if spec.get("reset"):
                resets.append(llm.reset_prefix_cache(reset_connector=True))
        ids = entry
        if isinstance(entry, dict):  # a follow-up: prompt i, what it generated, then more
            i = entry["after"]
            ids = sent[i] + out[i].get("tokens", []) + entry.get("extra", [])
        sent.append(ids)
        t = time.perf_counter()
        if n in set(spec.get("abort_wakes", [])):
            out.append(abort_wake(llm, f"abort-{n}", ids, params))
            continue
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt
        kv_params = spec.get("kv_params") or []
        asks = kv_params[n] if n < len(kv_params) else None
        sampling = params if asks is None else params.clone()
        if asks is not None:
            sampling.extra_args = {"kv_transfer_params": asks}
        envelopes = spec.get("kv_hints") or []
        envelope = envelopes[n] if n < len(envelopes) else None
        try:
            if envelope is not None:
                r = with_kv_hints(llm, f"hinted-{n}", prompt, sampling, envelope, lora)
            else:
                [r] = llm.generate([prompt], sampling, use_tqdm=False, lora_request=lora)
        except Exception as e:  # a request the engine failed: report it, keep serving
            out.append({"error": f"{type(e).__name__}: {e}"[:500]})
            continue
        c = r.outputs[0]
        out.append({
            "tokens": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
            "cached": r.num_cached_tokens,
            "kv_transfer_params": r.kv_transfer_params,
            "finish_reason": c.finish_reason,
            "seconds": time.perf_counter() - t,
            "sent_at": t,  # perf_counter: one clock with the connector's wake timeline
            **({} if late is None else {"late": late}),
        })
    metrics = {}
    if spec.get("metrics"):  # what vLLM's Prometheus logger holds (as /metrics serves it),
        # once the writes below host have landed and been counted; read from the registry
        # itself: llm.get_metrics() rounds counters to integers
        settle(llm)
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            for sample in family.samples:
                if not (sample.name.startswith("vllm:kvtier")
                        and sample.name.endswith("_total")):
                    continue
                extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                 if k not in ("engine", "model_name"))
                name = sample.name.removesuffix("_total")
                metrics[name + (f"{{{extra}}}" if extra else "")] = sample.value
    kv_events = listener.drain() if listener is not None else []
    pinned = host_pins(llm) if spec.get("abort_wakes") else None
    print(MARK + json.dumps({"started_s": started, "results": out, "concurrent": together,
                             "metrics": metrics, "kv_events": kv_events,
                             "resets": resets, "pinned": pinned}), flush=True)
    # vLLM's own shutdown: the connector closes, its writes below host land and are synced
    # (a later process reads them). Then out without the interpreter's teardown, which
    # collects torch's and vLLM's objects and leaves nothing to anyone (~2.8 s a run here).
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
