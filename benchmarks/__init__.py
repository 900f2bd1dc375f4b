"""Benchmarks of elastic_ddp against a bare DDP loop and stock torchrun.

`python benchmarks/run_all.py` runs them all and prints one table (docs/benchmarks.md has the
numbers, the exact commands and the machine they were measured on).
"""
