"""The chain memo gives exactly kvroute.common.blocks' chain, reusing the spans of prompts it has seen."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.blocks import block_hashes, namespace_seed, token_bytes
from kvroute.router.request.chain_memo import ChainMemo


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.integers(0, 2**32 - 1), max_size=700),
    extra=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.sampled_from([1, 4, 16]),
    salt=st.sampled_from([None, "a", "b"]),
)
def test_equal_to_block_hashes_on_prompts_and_their_extensions(base, extra, block_size, salt):
    memo = ChainMemo(span_blocks=4, max_spans=64)
    seed = namespace_seed("m", cache_salt=salt)
    for ids in (base, base + extra, base, extra + base, base + extra):
        assert memo.chain(token_bytes(ids), block_size, seed) == block_hashes(ids, block_size, seed)


def test_a_longer_turn_reuses_the_spans_of_the_earlier_one():
    rng = np.random.default_rng(3)
    memo = ChainMemo(span_blocks=8)
    turn1 = rng.integers(0, 50_000, 16 * 8 * 10 + 5).astype(np.uint32)
    memo.chain(token_bytes(turn1), 16, 7)
    assert (memo.hits, memo.misses) == (0, 10)
    turn2 = np.concatenate([turn1, rng.integers(0, 50_000, 300).astype(np.uint32)])
    assert memo.chain(token_bytes(turn2), 16, 7) == block_hashes(turn2, 16, 7)
    assert memo.hits == 10  # every span of turn 1 came from the memo
    # another seed or block size shares nothing
    assert memo.chain(token_bytes(turn2), 16, 8) == block_hashes(turn2, 16, 8)
    assert memo.chain(token_bytes(turn2), 8, 7) == block_hashes(turn2, 8, 7)
    assert memo.hits == 10


def test_bounded():
    memo = ChainMemo(span_blocks=1, max_spans=5)
    ids = list(range(16 * 20))
    memo.chain(token_bytes(ids), 16, 1)
    assert len(memo) == 5
