"""The c10d room: the TCPStore that `--rdzv_backend=elastic-c10d` stands on, below its board
(`boards.c10d`).

- `store`: which node hosts the store at `--rdzv_endpoint`, and reaching it.
- `watch`: a store that went silent: its node cut off (this node stops) or this one (it waits).
"""
