"""Chaos testing for elastic jobs: fault plans as data, a harness that plays them on local nodes.

- `plan`: `Fault`, `FaultPlan` (JSON), `random_plan(seed, ...)`.
- `harness`: `ChaosHarness(run_dir, training_args, plan).run()` -> `ChaosReport`, on torchrun
  agents on this machine as nodes (elastic_ddp/testbed/local_cluster.py), failed for real.
- `targets`: `FaultTargeting`, when each fault fires and which node it hits.
- `verdict`: `judge`, the promises checked after a run, and `ChaosReport`.
- `equivalence`: `run_reference`, `compare_runs`: same model as an uninterrupted run?
- `cli`: `python -m elastic_ddp.chaos` (also `elastic-ddp chaos`).
- `store`: a c10d rendezvous store in a process of its own, so that every node can be killed.
- `held_train`: `elastic_ddp.train` held at a slow pace until released, so a plan plays out in time.

docs/failure-semantics.md says what the promises are and what a chaos run checks.
"""
