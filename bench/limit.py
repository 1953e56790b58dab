"""The physical limit of TTFT: what no router can beat (docs/design.md §8).

For each request: its TTFT alone on an idle replica whose prefix cache is infinite and shared by
the whole fleet.  Only the never-seen part of its prompt prefills: the leading full blocks that
some earlier request (in arrival order) already had are cached, the rest is computed, exactly as
the emulated engine computes an isolated prefill (full-budget chunks, each a scheduler step with
its fixed overheads, attention over the context so far, at least the last token computed).  A
policy's TTFT percentiles divided by the limit's say how much of the gap is left to close.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LIMIT_KEYS = tuple(f"ttft_p{q}_s" for q in PERCENTILES)  # the JSON's "limit" object


def available_blocks(chains_in_order: Sequence[Sequence[int]]) -> list[int]:
    """Per request, the leading full blocks that some earlier request already had.

    One infinite cache shared by every replica: a chain's block hash identifies its whole prefix,
    so the match is the run of leading hashes already seen.  Uncapped (vLLM would recompute at
    least one token of a fully cached block-aligned prompt; engines' delivered figures are capped).
    """
    seen: set[int] = set()
    out: list[int] = []
    for chain in chains_in_order:
        m = 0
        for h in chain:
            if h not in seen:
                break
            m += 1
        out.append(m)
        seen.update(chain)
    return out


def prefill_seconds(profile: Any, uncached: int, cached: int) -> float:
    """Engine time to prefill `uncached` tokens after `cached` ones, in full-budget chunks, with
    attention over the context so far (long prompts cost more per token than short ones)."""
    budget = profile.max_num_batched_tokens
    total = 0.0
    done = cached
    left = uncached
    while left > 0:
        n = min(left, budget)
        total += profile.step_time(n, 0, 0, n * done + n * (n + 1) // 2)
        done += n
        left -= n
    return total


def isolated_ttft(profile: Any, prompt_tokens: int, seen_blocks: int, block_size: int) -> float:
    """TTFT of a lone request on an idle engine holding its first `seen_blocks` blocks: the
    engine's cache hit is capped so that the prompt's last token is computed (vLLM samples from it)."""
    cached = min(seen_blocks, (prompt_tokens - 1) // block_size) * block_size
    return prefill_seconds(profile, prompt_tokens - cached, cached)


def limit_ttfts(profile: Any, prompt_tokens: Sequence[int], seen_blocks: Sequence[int], block_size: int) -> np.ndarray:
    """Per request, its limit TTFT (seconds), given the leading blocks an earlier request had
    (`available_blocks` over the arrival order)."""
    return np.array(
        [isolated_ttft(profile, int(p), int(s), block_size) for p, s in zip(prompt_tokens, seen_blocks)], dtype=float
    )


def chains_of(prompts: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Block chains of token-id prompts (one namespace: only equality between them matters)."""
    from kvroute.common.blocks import block_hashes, namespace_seed

    seed = namespace_seed("kvroute-limit")
    return [block_hashes(ids, block_size, seed) for ids in prompts]


def percentiles(ttft: np.ndarray) -> dict[str, float]:
    """`{"ttft_p50_s", "ttft_p90_s", "ttft_p99_s"}` of a set of TTFTs (NaN when empty)."""
    if ttft.size == 0:
        return dict.fromkeys(LIMIT_KEYS, float("nan"))
    return {k: float(np.percentile(ttft, q)) for k, q in zip(LIMIT_KEYS, PERCENTILES)}


def fleet_limit(per_run: Sequence[np.ndarray]) -> np.ndarray:
    """One limit for several runs of the same workload (NaN where a run did not send a request).

    Open loop, every run sends the same requests in the same order and the limits are equal.
    Closed loop, a turn's arrival depends on how fast the policy answered the previous one: runs
    differ in which request first sends a shared prefix (a system prompt), and a window cuts
    different late turns.  The limit then covers the requests every run sent, each at its lowest
    per-run limit, so it stays below every run's TTFT request by request.
    """
    return np.vstack(per_run).min(axis=0)  # NaN (not sent by some run) propagates


def multiples(figures: dict[str, Any], limit: dict[str, float]) -> dict[str, float]:
    """A policy's TTFT percentiles as multiples of the limit's."""
    return {k: figures[k] / limit[k] if limit[k] else float("nan") for k in LIMIT_KEYS}
