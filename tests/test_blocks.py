"""Block-chain hashing: prefixes share leading hashes, any change breaks the chain from there on."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.blocks import block_hashes, extend_chain, hash_block, namespace_seed

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=300)
block_sizes = st.sampled_from([1, 4, 16, 32])
SEED = namespace_seed("m")


@given(tokens, block_sizes)
def test_full_blocks_only(ids, bs):
    assert len(block_hashes(ids, bs, SEED)) == len(ids) // bs


@given(tokens, tokens, block_sizes)
def test_equal_prefixes_give_equal_leading_hashes(common, tail, bs):
    a = block_hashes(common + tail, bs, SEED)
    b = block_hashes(common, bs, SEED)
    assert a[: len(b)] == b


@given(tokens, block_sizes, st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(ids, bs, data):
    if len(ids) < bs:
        return
    i = data.draw(st.integers(min_value=0, max_value=len(ids) - 1))
    changed = list(ids)
    changed[i] = (changed[i] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    a, b = block_hashes(ids, bs, SEED), block_hashes(changed, bs, SEED)
    first = i // bs
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


@settings(max_examples=300)
@given(st.text(max_size=20), st.text(max_size=20), st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=16))
def test_different_salts_never_share_the_first_block(salt_a, salt_b, ids):
    if salt_a == salt_b:
        return
    a = block_hashes(ids, 16, namespace_seed("m", cache_salt=salt_a))
    b = block_hashes(ids, 16, namespace_seed("m", cache_salt=salt_b))
    assert a[0] != b[0]


def test_namespace_separates_model_lora_and_salt():
    seeds = {
        namespace_seed("m"),
        namespace_seed("m2"),
        namespace_seed("m", lora="a"),
        namespace_seed("m", cache_salt="a"),
        namespace_seed("m", lora="x", cache_salt="y"),
        namespace_seed("m", lora="x\x1fy"),
    }
    assert len(seeds) == 6


@given(tokens, block_sizes)
def test_numpy_list_and_incremental_forms_agree(ids, bs):
    whole = block_hashes(ids, bs, SEED)
    assert block_hashes(np.array(ids, dtype=np.uint32), bs, SEED) == whole
    # a KV event carries one block's tokens and its parent's hash: it must land on the same chain
    parent = SEED
    for i, h in enumerate(whole):
        block = ids[i * bs : (i + 1) * bs]
        assert hash_block(parent, block) == h
        parent = h
    if whole:
        assert extend_chain(whole[0], ids[bs:], bs) == whole[1:]


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], 0, SEED)
