"""A long new prompt is routed as its whole prompt would be: the same replica, the same load.

Conversations shaped like real chat (shared system prompts of several sizes, long new first turns
of mixed text, later turns that add to them) go through the real router's ``route`` in front of
emulated replicas, some requests held in flight so that replicas' queues differ.  Before each
decision the reference is computed from the whole prompt's ids (the tokenizer's own encoding),
on a copy of the router's policy and the same index and load: the router must pick the same
replica and charge the same uncached tokens.  (Routing a long new prompt on its first characters,
with its tokens estimated from them, charged 0.2x-4x the real load on such text: docs/design.md
§1.)
"""

from __future__ import annotations

import copy
import json
import time

import numpy as np

from kvroute.bench.chat_text import chat_text
from kvroute.common.blocks import block_hashes, namespace_seed
from kvroute.router.placement.policy.base import Query
from kvroute.router.forwarding.proxy import Outcome
from kvroute.router.forwarding.sse import Usage
from kvroute.common.requests import parse_request
from tests.router_support import MODEL, TINY_TOKENIZER, emulated_replicas, running_router
from kvroute.common.tokens import Tokenizer

SYSTEM_CHARS = (1_500, 5_000, 12_000)
MAX_CHARS = 30_000  # a history stays within the replicas' context (32k tokens; ~1.2 characters a token here)


def conversations(seed: int, sessions: int, turns: int) -> list[tuple[str, list[dict]]]:
    """(session, messages) in arrival order: sessions interleaved, each turn adding to the last."""
    rng = np.random.default_rng(seed)
    systems = [chat_text((seed, 0, i), n) for i, n in enumerate(SYSTEM_CHARS)]
    history = {
        s: [{"role": "system", "content": systems[int(rng.integers(0, len(systems)))]},
            {"role": "user", "content": chat_text((seed, 1, s), int(min(16_000, rng.lognormal(np.log(7_000), 0.8))))}]
        for s in range(sessions)
    }
    left = {s: int(rng.integers(1, turns + 1)) for s in range(sessions)}
    out = []
    while left:
        s = int(rng.choice(sorted(left)))
        out.append((f"session-{s}", list(history[s])))
        history[s] += [{"role": "assistant", "content": chat_text((seed, 2, s, len(history[s])), int(rng.integers(200, 2_500)))},
                       {"role": "user", "content": chat_text((seed, 3, s, len(history[s])), int(min(12_000, rng.lognormal(np.log(2_500), 1.1))))}]
        left[s] -= 1
        if not left[s] or sum(len(m["content"]) for m in history[s]) > MAX_CHARS:
            del left[s]
    return out


async def test_a_long_new_prompt_lands_where_its_whole_prompt_would_and_is_charged_its_load():
    reference = Tokenizer.from_dir(TINY_TOKENIZER)
    async with emulated_replicas(8) as reps, running_router([r.url for r in reps]) as app:
        router = app.router
        block_size = app.fleet.block_size(MODEL)
        seed = namespace_seed(MODEL, None, None)
        in_flight: list = []
        same = charged = long_new = 0
        requests = conversations(seed=7, sessions=28, turns=5)
        for i, (session, messages) in enumerate(requests):
            ids = reference.encode(reference.render_chat(messages))
            chain = block_hashes(ids, block_size, seed)
            # the whole prompt's decision, on a copy of the policy, from the same index and load
            route = Query(chain=chain, prompt_tokens=len(ids), block_size=block_size, session_key=session,
                                 matches=app.index.lookup_now(chain), now=time.monotonic())
            expected = copy.deepcopy(app.policy).choose(route, router._snapshot(router.eligible(MODEL)))
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
            decision = await router.route(parse_request("chat", body), request_id=f"r{i}", session_header=session, api_key=None)

            long_new += len(messages) == 2
            same += decision.replica == expected.replica
            want = max(0, len(ids) - expected.matched_blocks * block_size)
            got = app.load._pending[decision.load_key].uncached
            charged += abs(got - want) <= 0.05 * max(want, block_size)
            # keep a few in flight (replicas' queues differ), answer the oldest
            in_flight.append(decision)
            if len(in_flight) > 6:
                done = in_flight.pop(0)
                app.accounting.first_token(done, 0.05)
                app.accounting.report(done, Outcome(replica=done.replica, status=200, usage=Usage(len(ids), 1, 0)))
        n = len(requests)
        assert long_new >= 20 and n >= 60
        assert same >= 0.99 * n, f"{n - same} of {n} requests went elsewhere than their whole prompt would"
        assert charged >= 0.99 * n, f"{n - charged} of {n} requests were charged a load >5% off their whole prompt's"
