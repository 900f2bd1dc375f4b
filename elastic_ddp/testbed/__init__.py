"""Local test beds that tests, benchmarks and `elastic-ddp chaos` share: torchrun nodes on this machine, an etcd server."""
