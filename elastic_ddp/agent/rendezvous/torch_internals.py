"""The one private name of torch's rendezvous that elastic_ddp relies on, named in one place.

The elastic-c10d store is hosted where torch's `c10d` would host it too (`matches_machine_hostname`,
in `c10d.store`; the same in torch 2.4 to 2.13). Nothing else in the package touches a private name
of torch's rendezvous (elastic_ddp's rendezvous names its nodes with `state.NodeDesc`, its own);
tests/unit/test_torch_internals.py pins this one (it exists, with the shape used here) so that a
torch upgrade that moves it fails there first, with the name.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname


def matches_machine_hostname(host: str) -> bool:
    """torch's rule for whether this machine hosts the c10d store at `host` (its host name or an
    address it resolves to); `c10d.store` hosts where this or its own interface rule says so."""
    return _matches_machine_hostname(host)
