"""The chat trace format (bench/chat_trace.py), the generated chat workloads (bench/chat_workloads.py)
and what the simulator makes of them (a chat workload's requests, a slower replica)."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import numpy as np
import pytest

from kvroute.bench import chat_workloads
from kvroute.bench.chat_trace import ChatTraceError, check_row, dump_chat_trace, load_chat_trace
from kvroute.bench.chat_workloads import CONVERSATION, MAX_CONTEXT_TOKENS, nominal_rate, rows, sim_workload
from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.replica.emulated.profile import DEFAULT_PROFILE
from kvroute.common.tokens import Tokenizer

N = 120


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def conversation() -> list[dict]:
    return rows("conversation", 3, N)


def by_session(rows_: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows_:
        out.setdefault(r["session_id"], []).append(r)
    return out


# --- the format -------------------------------------------------------------------------------


def test_chat_trace_round_trips_plain_and_gzipped_sorted_by_timestamp(tmp_path):
    rows_ = [
        {"timestamp": 500, "session_id": "a", "messages": [{"role": "user", "content": "hi ☃"}], "max_tokens": 4},
        {"timestamp": 100, "session_id": None, "messages": [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "q"}], "max_tokens": 9},
    ]
    for name in ("t.jsonl", "t.jsonl.gz"):
        path = dump_chat_trace(rows_, tmp_path / name)
        assert load_chat_trace(path) == [rows_[1], rows_[0]]
    with gzip.open(tmp_path / "t.jsonl.gz", "rt") as f:  # really gzipped, one object a line
        assert [json.loads(line)["timestamp"] for line in f] == [500, 100]


@pytest.mark.parametrize("row, field", [
    ({"session_id": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "timestamp"),
    ({"timestamp": "1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "timestamp"),
    ({"timestamp": 1, "session_id": 7, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "session_id"),
    ({"timestamp": 1, "messages": [], "max_tokens": 1}, "messages"),
    ({"timestamp": 1, "messages": [{"role": "robot", "content": "x"}], "max_tokens": 1}, "messages"),
    ({"timestamp": 1, "messages": [{"role": "user", "content": None}], "max_tokens": 1}, "messages"),
    ({"timestamp": 1, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"timestamp": 1, "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
])
def test_a_bad_row_is_refused_naming_its_field(row, field):
    with pytest.raises(ChatTraceError, match=field):
        check_row(row)


def test_a_file_with_a_bad_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 1, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}\n{oops\n')
    with pytest.raises(ChatTraceError, match="bad.jsonl:2"):
        load_chat_trace(path)


# --- the generators ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", chat_workloads.WORKLOADS)
def test_workloads_are_deterministic_valid_rows_and_a_smaller_one_is_part_of_a_larger(name):
    a, b = rows(name, 5, 40), rows(name, 5, 40)
    assert a == b and len(a) == 40
    assert rows(name, 6, 40) != a
    for r in a:
        check_row(r)
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)
    larger = {json.dumps(r, sort_keys=True) for r in rows(name, 5, 80)}
    assert all(json.dumps(r, sort_keys=True) in larger for r in a)


def test_conversation_opens_on_shared_system_prompts_then_a_long_new_first_turn(conversation, tok):
    sessions = by_session(conversation)
    assert len(sessions) >= 3 * 8  # several times the gate's 8 replicas
    firsts = [turns[0] for turns in sessions.values()]
    assert all([m["role"] for m in f["messages"]] == ["system", "user"] for f in firsts)
    systems = Counter(f["messages"][0]["content"] for f in firsts)
    assert 2 <= len(systems) <= len(CONVERSATION.system_tokens)  # a few, shared
    sizes = sorted(len(tok.encode(s)) for s in systems)
    assert sizes[-1] > 5 * sizes[0]  # of several sizes
    first_user = [f["messages"][1]["content"] for f in firsts]
    assert len(set(first_user)) == len(first_user)  # new: no session shares its first turn
    first_tokens = np.array([len(tok.encode(t)) for t in first_user])
    later_tokens = np.array([len(tok.encode(r["messages"][-1]["content"])) for t in sessions.values() for r in t[1:]])
    assert np.median(first_tokens) > 2000 and first_tokens.max() > 10_000  # long, heavy-tailed
    assert np.median(later_tokens) < np.median(first_tokens) / 5  # later turns are short


def test_conversation_turns_extend_the_history_and_sessions_overlap(conversation):
    spans = []
    for turns in by_session(conversation).values():
        for prev, cur in zip(turns, turns[1:]):
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]  # the whole history re-sent
            added = cur["messages"][len(prev["messages"]):]
            assert [m["role"] for m in added] == ["assistant", "user"]
            assert cur["timestamp"] - prev["timestamp"] >= 1000 * CONVERSATION.think_s.lo  # a human thinks
        spans.append((turns[0]["timestamp"], turns[-1]["timestamp"]))
    live = [sum(a <= t <= b for a, b in spans) for t, _ in spans]
    assert max(live) >= 4  # several conversations at once


@pytest.mark.parametrize("name", chat_workloads.WORKLOADS)
def test_every_prompt_and_its_reply_fit_the_context(name, tok):
    for r in rows(name, 1, N):
        assert len(tok.encode_chat(r["messages"])) + r["max_tokens"] <= MAX_CONTEXT_TOKENS


def test_sessions_shape_is_lmcache_multi_round_qa():
    sessions = by_session(rows("sessions", 2, 200))
    complete = list(sessions.values())[:-1]  # the last session is cut at the request count
    assert all(len(t) <= 8 for t in complete)
    assert sum(len(t) >= 3 for t in complete) >= 0.8 * len(complete)  # fewer only where the context ran out
    assert all(100 <= r["max_tokens"] <= 300 for t in complete for r in t)
    assert len({t[0]["messages"][0]["content"] for t in complete}) == 4  # four shared system prompts


def test_handbook_is_one_shared_document_and_unique_questions(tok):
    rows_ = rows("handbook", 0, 60)
    assert {r["session_id"] for r in rows_} == {None}
    assert len({r["messages"][0]["content"] for r in rows_}) == 1
    assert len({r["messages"][1]["content"] for r in rows_}) == 60
    assert 3500 < len(tok.encode(rows_[0]["messages"][0]["content"])) <= 4100
    gaps = np.diff([r["timestamp"] for r in rows_]) / 1000
    assert 0.5 < gaps.mean() < 1.5  # Poisson, one a second


# --- the simulator's view ---------------------------------------------------------------------


def test_sim_workload_keeps_tokens_sessions_and_times(tok):
    rows_ = rows("sessions", 0, 20)
    ids = [tok.encode_chat(r["messages"]) for r in rows_]
    w = sim_workload("sessions", rows_, ids, seconds_per_ms=1e-3 / 4)
    assert [list(r.tokens()) for r in w.requests] == ids
    assert [r.session_key for r in w.requests] == [r["session_id"] for r in rows_]
    assert [r.max_tokens for r in w.requests] == [r["max_tokens"] for r in rows_]
    assert w.requests[-1].arrival_s == pytest.approx((rows_[-1]["timestamp"] - rows_[0]["timestamp"]) / 4000)
    assert w.rate == pytest.approx(4 * nominal_rate(rows_), rel=1e-6)


def test_a_slower_replica_in_the_simulator_answers_ten_times_slower(tok):
    from kvroute.bench.sim import FleetConfig, prepare, simulate_policy, slowed
    from kvroute.router.placement.policy import make_policy

    assert slowed(DEFAULT_PROFILE, 10).step_time(2048, 4, 4000, 10**6) == pytest.approx(
        10 * DEFAULT_PROFILE.step_time(2048, 4, 4000, 10**6))
    rows_ = rows("handbook", 0, 60)
    ids = [tok.encode_chat(r["messages"]) for r in rows_]
    prepared = prepare(sim_workload("handbook", rows_, ids, seconds_per_ms=1e-3 / 20), DEFAULT_PROFILE.block_size)
    run = simulate_policy(prepared, make_policy("round_robin"), FleetConfig(3, DEFAULT_PROFILE, slowdown=(1.0, 1.0, 10.0)))
    ttft = run.first_token - run.arrival
    fast, slow = np.median(ttft[run.replica < 2]), np.median(ttft[run.replica == 2])
    assert slow > 5 * fast
