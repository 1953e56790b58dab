"""The live routing gate's parts (bench/routing_gate.py runs them): its settings, its workloads
and their preparation (workloads.py), the processes of one run (processes.py: the emulated fleet,
a router, the replay), the verdict against the measured spread (verdict.py), the tables
(report.py).  docs/routing-gate.md says what it runs and why."""
