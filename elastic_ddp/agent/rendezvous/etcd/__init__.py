"""The etcd room: what `--rdzv_backend=etcd-v3` stands on, below its board (`boards.etcd`).

- `options`: the `--rdzv_conf` keys, parsed and checked before anything connects.
- `client`: the one place that imports the `etcd3` client, around its protobuf problem.
- `connection`: one process's connection: failover, retries, TLS, auth and the key lease.
- `store`: `EtcdV3Store`, the torchrun agents' c10d store in etcd.

Nothing here is imported by this package's `__init__`: `options` loads without etcd3 or protobuf;
the other three import `client`, which sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION as it needs
before etcd3 loads. See docs/etcd.md.
"""
