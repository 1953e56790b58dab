"""Block-chain hashing speed: `python -m kvroute.bench.hash_bench`.

Hashes an 8,192-token prompt (block size 16 -> 512 blocks) many times and prints the median and
p99 per call, for a numpy uint32 array (the tokenizer path can hand one over) and a Python list.
"""

from __future__ import annotations

import argparse
import numpy as np

from kvroute.bench.timing import per_call_us
from kvroute.common.blocks import block_hashes, namespace_seed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 150_000, args.tokens, dtype=np.uint32)
    ids = arr.tolist()
    seed = namespace_seed("bench-model")
    print(f"{args.tokens} tokens, block size {args.block_size} ({args.tokens // args.block_size} blocks)")
    for name, data in (("numpy uint32", arr), ("python list", ids)):
        p50, p99 = per_call_us(lambda d=data: block_hashes(d, args.block_size, seed), args.repeat)
        print(f"  {name:<13} p50 {p50:7.1f} us   p99 {p99:7.1f} us")


if __name__ == "__main__":
    main()
