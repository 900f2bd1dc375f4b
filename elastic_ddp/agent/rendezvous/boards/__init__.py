"""The boards: where the nodes of one run meet, one per holder of a round's keys.

A board keeps a run's arrivals, liveness and round records, and closes a round with one
conditional write; the rendezvous (`handler.RoundRendezvousHandler`) reads it and decides. Its
contract is `handler.RoundBoard` (with `handler.BoardView`, one read of it), held there next to
the one caller; tests/cluster/test_board_contract.py holds every board to it.

- `etcd`: the board in etcd v3, on leases (`--rdzv_backend=etcd-v3`; its plumbing is `etcd/`).
- `c10d`: the board in the c10d TCPStore, on heartbeat times (`--rdzv_backend=elastic-c10d`; the
  store itself is `c10d/`).

Each module also builds its backend's handler (`create_etcd_v3_handler`,
`create_elastic_c10d_handler`), which `plugin` imports on first use.
"""
