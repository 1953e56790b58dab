"""Where a policy's reuse goes: each routing decision checked against the engines' caches.

    python -m kvroute.bench.reuse_loss --workload trace --replicas 8 --seed 1 --policy cost_model,sglang_cache_aware

The flags are `kvroute sim`'s (same requests, rate and fleet).  Per request, just before the
decision, it reads how many leading blocks of the prompt each engine's prefix cache holds and what
the index answers; after the run it sums, in blocks:

- ``available``: one infinite cache shared by the fleet (`kvroute sim`'s denominator);
- ``fleet_held``: the longest prefix any engine held at the decision: what the fleet's caches
  kept, whatever this decision does;
- ``left_holder``: ``fleet_held`` minus what the chosen engine held, where positive: the request
  left the engine holding more.  ``index_lost`` is the part where the index matched that engine
  less deeply than it held (the index had dropped blocks the engine still held); the rest, with
  the index knowing, is the policy's choice;
- ``lost_after`` / ``gained_after``: blocks the chosen engine held at the decision but evicted
  before the prefill, or came to hold by then (an earlier request on the same prefix computed
  them);
- ``delivered``: the engines' cached tokens, in blocks.

``delivered = fleet_held - left_holder - lost_after + gained_after``.  Comparing two policies'
``fleet_held`` separates what their placements made the caches keep from what their choices
then used.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from kvroute.router.placement.policy import make_policy

from kvroute.bench.sim import FleetConfig, FleetSim, PreparedWorkload, drive
from kvroute.bench.sim_cli import parse_args, prepared_workload, resolve_policies, resolve_profile

LOSS_KEYS = ("available", "fleet_held", "left_holder", "index_lost", "lost_after", "gained_after", "delivered")


class AuditedSim(FleetSim):
    """``FleetSim`` that records, before each decision, what every engine and the index hold."""

    def __init__(self, prepared: PreparedWorkload, policy: Any, cfg: FleetConfig):
        super().__init__(prepared, policy, cfg)
        n = len(self.requests)
        self.held_best = np.zeros(n, dtype=np.int64)  # the longest prefix any engine held
        self.held_chosen = np.zeros(n, dtype=np.int64)  # what the chosen engine held
        self.indexed_best = np.zeros(n, dtype=np.int64)  # what the index matched on the best engine

    def _route(self, i: int, arrival: float) -> None:
        chain = self.prepared.chains[i].tolist()
        held = [len(e.pool.longest_prefix(chain, len(chain))) for e in self.engines]
        # The same lookup the placement makes next, at the same virtual time: it changes nothing.
        matches = drive(self.index.lookup(chain))
        super()._route(i, arrival)
        best = int(np.argmax(held))
        self.held_best[i] = held[best]
        self.held_chosen[i] = held[self.run.replica[i]]
        self.indexed_best[i] = matches.get(self.names[best], 0)


def audit(sim: AuditedSim) -> dict[str, int]:
    """The sums of the module docstring, in blocks, over the requests sent."""
    run = sim.simulate()
    sent = run.replica >= 0
    delivered = run.cached_tokens // run.block_size
    left = np.maximum(sim.held_best - sim.held_chosen, 0)
    after = delivered - sim.held_chosen
    sums = {
        "available": run.available,
        "fleet_held": sim.held_best,
        "left_holder": left,
        "index_lost": np.where(sim.indexed_best < sim.held_best, left, 0),
        "lost_after": np.maximum(-after, 0),
        "gained_after": np.maximum(after, 0),
        "delivered": delivered,
    }
    return {k: int(v[sent].sum()) for k, v in sums.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), "python -m kvroute.bench.reuse_loss", __doc__.splitlines()[0])
    profile = resolve_profile(args.profile, "python -m kvroute.bench.reuse_loss")
    prepared, _ = prepared_workload(args, profile)
    cfg = FleetConfig(replicas=args.replicas, profile=profile, kv_events=args.kv_events)
    results = {name: audit(AuditedSim(prepared, make_policy(name, seed=args.seed), cfg)) for name in resolve_policies(args.policy)}
    if args.json:
        sys.stdout.write(json.dumps({"policies": results, "unit": "blocks"}) + "\n")
        return 0
    print(f"{'policy':<20}" + "".join(f"{k:>14}" for k in LOSS_KEYS) + "   (blocks)")
    for name, sums in results.items():
        print(f"{name:<20}" + "".join(f"{sums[k]:>14,}" for k in LOSS_KEYS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
