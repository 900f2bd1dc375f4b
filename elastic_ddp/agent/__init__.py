"""The agent side: what runs inside torchrun's own process (rendezvous handlers, the warm-worker launcher).

Nothing here imports the training side: an agent must start fast and never fail on a worker's import.
"""
