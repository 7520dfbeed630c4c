"""Which address and network interface this process uses for the job's traffic (Linux).

Hostnames do not tell machines apart reliably (containers, network namespaces, cloned images), and a
multi-homed node often talks on an unexpected interface. The address is what the logs, the failure
messages and `ddptrain doctor` show next to the hostname.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from collections.abc import Mapping

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one, by interface name."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _configured_interface(environ: Mapping[str, str], addresses: dict[str, str]) -> str | None:
    """The interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, if one is set and exists.

    GLOO_SOCKET_IFNAME lists exact names; NCCL_SOCKET_IFNAME lists prefixes, '=name' for an exact name
    and '^name' to exclude (an exclusion list selects nothing here: the route decides).
    """
    for var, exact in (("GLOO_SOCKET_IFNAME", True), ("NCCL_SOCKET_IFNAME", False)):
        first = environ.get(var, "").split(",")[0].strip()
        if not first or first.startswith("^"):
            continue
        if first.startswith("="):
            first, exact = first[1:], True
        for name in addresses:
            if name == first or (not exact and name.startswith(first)):
                return name
    return None


def route_source(host: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach `host` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            return sock.getsockname()[0]
    except OSError:  # unresolvable or unroutable
        return None


def job_address(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(address, interface) this process uses to talk to the job.

    The interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins (the backends bind to it);
    otherwise the route towards MASTER_ADDR; otherwise the hostname's address.
    """
    env = os.environ if environ is None else environ
    addresses = interface_addresses()
    name = _configured_interface(env, addresses)
    if name is not None:
        return addresses[name], name
    addr = None
    if env.get("MASTER_ADDR"):
        addr = route_source(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "9") or 9))
    if addr is None:
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
    by_addr = {a: n for n, a in addresses.items()}
    return addr, by_addr.get(addr, "?")


_ADDRESS = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")


def peers_named_in(text: str, addrs: list[str], own_addr: str) -> dict[str, list[int]]:
    """Ranks by address, for the other nodes' addresses that appear in an error message.

    Gloo and NCCL name the peer they lost by address ("Connection reset by peer [10.0.0.2]:4567");
    mapping it back to ranks turns that into "rank 2, 3 on host B". Addresses of this node are skipped:
    on one machine every rank shares them and naming them all would say nothing.
    """
    named: dict[str, list[int]] = {}
    for addr in dict.fromkeys(_ADDRESS.findall(text)):
        ranks = [rank for rank, a in enumerate(addrs) if a == addr]
        if ranks and addr != own_addr:
            named[addr] = ranks
    return named


def lost_peers_note(text: str, hosts: list[str], addrs: list[str], own_addr: str) -> str:
    """'; lost rank 2, 3 on host b (10.0.0.2): ...' for each other node an error message names, else ''."""
    named = peers_named_in(text, addrs, own_addr)
    return "".join(f"; lost rank {', '.join(map(str, ranks))} on host {hosts[ranks[0]]} ({addr}): that node's "
                   "processes died or its network failed" for addr, ranks in named.items())


def _ranks(ranks: list[int]) -> str:
    """'ranks 0-3', 'ranks 0, 2', 'rank 5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"


def describe_hosts(hosts: list[str], addrs: list[str]) -> str:
    """'a (10.0.0.1): ranks 0-1 · a (10.0.0.2): ranks 2-3' — hosts may share a name, never an address."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, key in enumerate(zip(hosts, addrs)):
        groups.setdefault(key, []).append(rank)
    return " · ".join(f"{host} ({addr}): {_ranks(ranks)}" for (host, addr), ranks in groups.items())
