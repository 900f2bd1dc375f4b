"""A c10d rendezvous store in a process of its own, so that no training node hosts it.

    python -m elastic_ddp.chaos.store 127.0.0.1:29400

With `--rdzv_backend=c10d` the store lives in the agent of the node at `--rdzv_endpoint`, and that
node cannot be lost (docs/failure-semantics.md). The chaos harness starts this process instead and
gives every agent `is_host=false` in `--rdzv_conf`, so that every training node, rank 0's included,
can be killed. It is a rehearsal device: the store process is itself a single point of failure;
on a real cluster use the etcd-v3 backend (docs/etcd.md).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_ddp.chaos.store", description=__doc__.split("\n")[0])
    parser.add_argument("endpoint", help="HOST:PORT to listen on")
    args = parser.parse_args(argv)
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"endpoint: got {args.endpoint!r}; expected HOST:PORT")

    from torch.distributed import TCPStore  # late: --help and usage errors stay fast

    # TCPStore listens on every interface of the machine by itself; a socket bound here first and
    # handed over makes it listen on HOST alone, as the log line says.
    listener = socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=128)
    store = TCPStore(host, int(port), is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60), master_listen_fd=listener.fileno())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logger.info("c10d store listening on %s:%s (that address only)", host, port)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        while True:
            signal.pause()
    finally:
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
