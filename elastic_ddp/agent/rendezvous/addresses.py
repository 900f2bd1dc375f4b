"""This node's addresses: which it publishes, which interface holds it, whether it holds an endpoint.

torch decides two things from the machine's host name, and on many machines the host name resolves
to loopback (`127.0.1.1 host` in /etc/hosts on Debian and Ubuntu, `127.0.0.1 vm` here, an address
on a second interface): which node hosts the c10d store (`_matches_machine_hostname`), and which
address gloo advertises to its peers. Our backends decide both from the machine's interfaces:

- `holds(host)`: whether an interface of this machine holds an address `host` resolves to (the
  node that does hosts the c10d store at `--rdzv_endpoint`, `rendezvous.c10d.store`);
- `interface_holding(host)`: the interface that holds this node's published address
  (`--local_addr`, else its FQDN, as torch names the node), which `worker_interface_environment`
  names to the workers' gloo and NCCL (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`) unless the user
  set them;
- `loopback_problem`: the one line for a node that would publish a loopback address to peers that
  meet at a non-loopback endpoint, naming `--local_addr` and the address this node reaches the
  endpoint from (the backends raise it, or warn where the peers may all be on this machine).

The interface table comes from the C library's `getifaddrs` (every address of every interface,
IPv4 and IPv6; Linux and macOS), read with ctypes: no dependency, nothing parsed. Where it is not
available, `interface_addresses()` is None and the callers keep torch's behaviour.

Not guaranteed: an address held by no interface of this machine (behind NAT, a floating address
another machine answers for) is not recognised as this node's; the store host then has to be named
with `--rdzv_conf is_host=1` and the interface with `GLOO_SOCKET_IFNAME`, as with stock torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
import sys

logger = logging.getLogger(__name__)

# The variables that choose the interface of gloo's and NCCL's sockets in the workers.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class _IfAddrs(ctypes.Structure):
    pass


# struct ifaddrs (the same field order on Linux and macOS; the last union is one pointer).
_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p), ("ifa_netmask", ctypes.c_void_p), ("ifa_dstaddr", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]
# Where a struct sockaddr keeps its family, and where sockaddr_in / sockaddr_in6 keep the address.
_FAMILY_OFFSET = 1 if sys.platform == "darwin" else 0  # macOS: a length byte, then a one-byte family
_ADDRESS_AT = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}


def _libc() -> ctypes.CDLL | None:
    if sys.platform not in ("linux", "darwin"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
        libc.freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
    except (OSError, AttributeError):
        return None
    return libc


def _sockaddr_address(pointer: int) -> IPAddress | None:
    if not pointer:
        return None
    raw = ctypes.string_at(pointer, 24)
    family = raw[_FAMILY_OFFSET] if _FAMILY_OFFSET else int.from_bytes(raw[0:2], sys.byteorder)
    if family not in _ADDRESS_AT:
        return None
    start, length = _ADDRESS_AT[family]
    return ipaddress.ip_address(raw[start:start + length])


def interface_addresses() -> dict[str, list[IPAddress]] | None:
    """Every interface of this machine (up or down) and its IPv4 and IPv6 addresses, in the kernel's
    order; None where `getifaddrs` is not available (the callers then keep torch's behaviour)."""
    libc = _libc()
    if libc is None:
        return None
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        logger.debug("getifaddrs failed: %s", os.strerror(ctypes.get_errno()))
        return None
    table: dict[str, list[IPAddress]] = {}
    try:
        entry = head
        while entry:
            name = entry.contents.ifa_name.decode(errors="replace")
            address = _sockaddr_address(entry.contents.ifa_addr)
            addresses = table.setdefault(name, [])
            if address is not None and address not in addresses:
                addresses.append(address)
            entry = entry.contents.ifa_next
    finally:
        libc.freeifaddrs(head)
    return table


def resolve(host: str) -> list[IPAddress]:
    """The addresses `host` (a name or an address, IPv6 with or without brackets) resolves to, in
    the resolver's order; [] when it does not resolve."""
    host = host.strip("[]")
    try:
        return [ipaddress.ip_address(host.split("%")[0])]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addresses: list[IPAddress] = []
    for family, _, _, _, sockaddr in found:
        if family in _ADDRESS_AT:
            address = ipaddress.ip_address(sockaddr[0].split("%")[0])
            if address not in addresses:
                addresses.append(address)
    return addresses


def interface_holding(host: str, table: dict[str, list[IPAddress]] | None = None) -> str | None:
    """The interface of this machine that holds an address `host` resolves to (the first such
    address in the resolver's order), or None: no interface holds one, or no table here."""
    table = interface_addresses() if table is None else table
    for address in resolve(host):
        for name, addresses in (table or {}).items():
            if address in addresses:
                return name
    return None


def holds(host: str, table: dict[str, list[IPAddress]] | None = None) -> bool | None:
    """Whether an interface of this machine holds an address `host` resolves to; None where this
    machine's interfaces cannot be listed (`interface_addresses`)."""
    table = interface_addresses() if table is None else table
    if table is None:
        return None
    return interface_holding(host, table) is not None


def is_loopback(host: str) -> bool:
    """Whether `host` is `localhost` or resolves to loopback addresses only (127.0.0.0/8, ::1)."""
    if host.strip("[]").lower() == "localhost":
        return True
    addresses = resolve(host)
    return bool(addresses) and all(address.is_loopback for address in addresses)


def published_address(local_addr: str | None) -> str:
    """The address torch publishes for this node: `--local_addr`, else the machine's FQDN."""
    return local_addr or socket.getfqdn()


def source_address(host: str, port: int) -> str | None:
    """The address this machine sends from to reach `host:port` (its routing table's choice, no
    packet sent), or None when there is no route or `host` does not resolve."""
    for address in resolve(host):
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((str(address), port))
                return probe.getsockname()[0]
        except OSError:
            continue
    return None


def loopback_problem(local_addr: str | None, endpoint_host: str, endpoint_port: int) -> str | None:
    """One line saying that this node would publish a loopback address (`--local_addr`, else its
    host name) to peers that meet at a non-loopback endpoint, where they would connect to their own
    loopback, and which `--local_addr` to pass instead; None when there is no such problem."""
    published = published_address(local_addr)
    if is_loopback(endpoint_host) or not is_loopback(published):
        return None
    source = source_address(endpoint_host, endpoint_port)
    suggestion = f"--local_addr={source}" if source and not ipaddress.ip_address(source).is_loopback else \
        "--local_addr=<this node's address on the network of the endpoint>"
    named = f"--local_addr={local_addr}" if local_addr else f"its host name {published!r} (no --local_addr given)"
    return (f"this node would publish {named}, a loopback address ({_listed(resolve(published))}), to peers that "
            f"meet at the rendezvous endpoint {endpoint_host}:{endpoint_port}, and they cannot reach it there: pass "
            f"{suggestion}")


def worker_interface_environment(published: str, environ=os.environ,
                                 table: dict[str, list[IPAddress]] | None = None) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` naming the interface that holds `published`
    (in `table`, default this machine's), for those of them that `environ` does not set; {} when
    `published` is loopback (one machine: the libraries' own choice works) or no interface holds it."""
    if is_loopback(published):
        return {}
    missing = [name for name in INTERFACE_VARIABLES if not environ.get(name)]
    if not missing:
        return {}
    interface = interface_holding(published, table)
    if interface is None:
        logger.info("no interface of this machine holds %s (this node's published address): gloo and NCCL choose "
                    "their own (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if they choose wrong)", published)
        return {}
    return {name: interface for name in missing}


def _listed(addresses: list[IPAddress]) -> str:
    return ", ".join(str(address) for address in addresses) or "does not resolve"
