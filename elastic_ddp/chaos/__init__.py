"""Chaos testing for elastic jobs: fault plans as data, a harness that plays them on local nodes.

- `plan`: `Fault`, `FaultPlan` (JSON), `random_plan(seed, ...)`.
- `cluster`: torchrun agents on this machine as nodes (`LocalNode`, `LocalJob`), failed for real.
- `harness`: `ChaosHarness(run_dir, training_args, plan).run()` -> `ChaosReport`.
- `verdict`: `judge`, the promises checked after a run, and `ChaosReport`.
- `equivalence`: `run_reference`, `compare_runs`: same model as an uninterrupted run?
- `cli`: `python -m elastic_ddp.chaos` (also `elastic-ddp chaos`).
- `store`: a c10d rendezvous store in a process of its own, so that every node can be killed.

docs/failure-semantics.md says what the promises are and what a chaos run checks.
"""
