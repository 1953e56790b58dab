"""Pieces of the routing pipeline: LoRA namespaces, tenant salts, client labels, approximate tokens."""

from __future__ import annotations

from kvroute.common.blocks import block_hashes, namespace_seed
from kvroute.router.fleet.breaker import CircuitBreaker
from kvroute.router.fleet.replica import Replica
from kvroute.router.fleet.catalogue import adapter_of
from kvroute.router.request.prompt import approximate_token_bytes, chat_text
from kvroute.router.request.route import client_label, tenant_salt


def _replica(cards: list[dict]) -> Replica:
    return Replica(name="http://r:1", url="http://r:1", breaker=CircuitBreaker(), model_cards=cards,
                   models={c["id"] for c in cards})


def test_lora_adapter_gets_its_own_namespace():
    r = _replica([{"id": "llama", "root": "/m/llama", "parent": None},
                  {"id": "sql-lora", "root": "/adapters/sql", "parent": "llama"}])
    assert adapter_of("llama", [r]) == (None, "llama")
    assert adapter_of("sql-lora", [r]) == ("sql-lora", "llama")
    assert adapter_of("unknown", [r]) == (None, "unknown")
    ids = list(range(64))
    base = block_hashes(ids, 16, namespace_seed("llama"))
    lora = block_hashes(ids, 16, namespace_seed("llama", "sql-lora"))
    assert not set(base) & set(lora)


def test_tenant_salt_is_keyed_and_hides_the_key():
    a, b = tenant_salt("key-a", b"secret"), tenant_salt("key-b", b"secret")
    assert a != b and "key-a" not in a and len(a) == 32
    assert tenant_salt("key-a", b"other secret") != a  # routers must share the secret to agree
    assert tenant_salt("key-a", b"secret") == a


def test_client_label_never_exposes_the_key():
    assert client_label("alice", "sk-123") == "alice"
    label = client_label(None, "sk-123")
    assert label.startswith("key-") and "sk-123" not in label
    assert client_label(None, None) == "anonymous"


def test_approximate_tokens_keep_text_prefixes_as_block_prefixes():
    shared = "You are a helpful assistant. " * 20
    a = approximate_token_bytes(shared + "question one " * 10)
    b = approximate_token_bytes(shared + "another question " * 10)
    assert len(a) % 4 == 0
    ha, hb = block_hashes(memoryview(a).cast("I"), 16, 1), block_hashes(memoryview(b).cast("I"), 16, 1)
    common = len(shared.encode()) // 64  # 16 pseudo tokens of 4 bytes per block
    assert ha[:common] == hb[:common] and ha[common:] != hb[common:]


def test_chat_text_flattens_parts():
    text = chat_text([{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "user", "content": None}])
    assert text == "<system>a\nb\n<user>"


def test_routing_chooses_again_when_the_pick_cannot_be_claimed():
    # Round robin picks b second; b is half-open and its trial was taken meanwhile (claim refuses):
    # the request goes to another replica instead, and nothing is booked on b.
    from types import SimpleNamespace

    from kvroute.common.tokens import TokenizerRegistry
    from kvroute.router.config import RouterSettings
    from kvroute.router.index.client import IndexClient
    from kvroute.router.index.memory import MemoryIndex
    from kvroute.router.metrics import RouterMetrics
    from kvroute.router.placement.load import LoadTracker
    from kvroute.router.placement.policy.base import Query
    from kvroute.router.placement.policy.round_robin import RoundRobinPolicy
    from kvroute.router.placement.sequence import Placement
    from kvroute.router.request.prompt import PromptBuilder
    from kvroute.router.request.route import Router

    load = LoadTracker()
    claimed: list[str] = []
    policy = RoundRobinPolicy()
    placement = Placement(policy, IndexClient(MemoryIndex()), load)
    fleet = SimpleNamespace(claim=lambda name: claimed.append(name) or name != "b")
    router = Router(RouterSettings(), fleet=fleet, placement=placement,
                    prompts=PromptBuilder(TokenizerRegistry(), want_text=False),
                    metrics=RouterMetrics(policy.name, policy.reasons))
    replicas = [Replica(name=n, url=n, breaker=CircuitBreaker()) for n in ("a", "b")]
    picks = [router._place(Query(chain=(), prompt_tokens=8, block_size=16), replicas, f"k{i}", ((),))[1].replica
             for i in range(2)]
    assert picks == ["a", "a"] and claimed == ["a", "b", "a"]
    assert load.state("a").in_flight == 2 and load.state("b").in_flight == 0
