"""A client that resolves names as one region's clients do: ask a given DNS server, from the region's address.

With BIND views (bench/dns/bind.py) the answer depends on the source address of the query, so a client of region
R must ask from R's address; the system resolver (getaddrinfo, aiohttp's default) can do neither that nor a
non-standard port. :class:`SourceResolver` is an aiohttp resolver that asks through dnspython (already the
controller's DNS library) with ``source=``, and keeps each answer for its TTL, as a caching stub resolver would;
:func:`region_connector` wraps it in a TCPConnector that also opens its HTTP connections from that address, so
the balancer sees the client where DNS placed it.

aiohttp's own AsyncResolver (aiodns / c-ares) could do the same through c-ares options, at the price of two more
native dependencies; dnspython is pure Python and already required.
"""

from __future__ import annotations

import ipaddress
import socket
import time

import aiohttp
import dns.asyncquery
import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype
from aiohttp.abc import AbstractResolver, ResolveResult

__all__ = ["SourceResolver", "region_connector", "MAX_CACHED_NAMES"]

#: Names a resolver keeps answers for; a client of one service asks for one or two.
MAX_CACHED_NAMES = 64


class SourceResolver(AbstractResolver):
    """Resolve A (or AAAA) records by asking ``server``:``port`` over UDP from ``source``.

    Args:
        server, port: the DNS server (an IP address); source: the local address queries are sent from (None: any);
        timeout_s: bound on one query (s). Names that are IP literals are returned as they are.
    """

    def __init__(self, server: str, port: int = 53, *, source: str | None = None, timeout_s: float = 2.0):
        self.server, self.port, self.source, self.timeout_s = server, port, source, timeout_s
        self._cache: dict[tuple[str, int], tuple[float, list[str]]] = {}

    async def addresses(self, host: str, family: int = socket.AF_INET) -> list[str]:
        """The addresses the server answers for ``host`` (A for AF_INET, AAAA for AF_INET6; AF_UNSPEC: A), from
        the cache while their TTL lasts. Raises OSError when the server cannot be asked or has no address."""
        rdtype = dns.rdatatype.AAAA if family == socket.AF_INET6 else dns.rdatatype.A
        now = time.monotonic()
        cached = self._cache.get((host, rdtype))
        if cached and cached[0] > now:
            return cached[1]
        query = dns.message.make_query(host, rdtype)
        try:
            response = await dns.asyncquery.udp(query, self.server, port=self.port, source=self.source,
                                                timeout=self.timeout_s)
        except (dns.exception.DNSException, OSError) as exc:  # aiohttp reports OSError as a DNS error
            raise OSError(f"DNS query for {host} at {self.server}:{self.port} from {self.source}: "
                          f"{type(exc).__name__}: {exc}") from exc
        # The server's answer may be a CNAME chain ending in addresses; the addresses are what a client dials.
        rrsets = [r for r in response.answer if r.rdtype == rdtype]
        if response.rcode() != dns.rcode.NOERROR or not rrsets:
            raise OSError(f"{host}: no {dns.rdatatype.to_text(rdtype)} record at {self.server}:{self.port} "
                          f"({dns.rcode.to_text(response.rcode())})")
        addresses = [r.address for rrset in rrsets for r in rrset]
        if len(self._cache) >= MAX_CACHED_NAMES:
            self._cache.clear()
        self._cache[(host, rdtype)] = (now + min(r.ttl for r in rrsets), addresses)
        return addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        """aiohttp's resolver interface: one result per address."""
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = [ipaddress.ip_address(a) for a in await self.addresses(host, family)]
        return [ResolveResult(hostname=host, host=str(a), port=port, proto=0, flags=socket.AI_NUMERICHOST,
                              family=socket.AF_INET6 if a.version == 6 else socket.AF_INET) for a in addresses]

    async def close(self) -> None:
        """Nothing to release: each query opens and closes its own socket."""


def region_connector(server: str, port: int, source: str, **kwargs) -> aiohttp.TCPConnector:
    """A TCPConnector for one region's clients: names resolved by :class:`SourceResolver` from ``source``,
    HTTP connections opened from ``source`` too. aiohttp's own DNS cache is off (the resolver keeps answers for
    their TTL instead, so a DNS change reaches new connections within the TTL); ``kwargs`` go to TCPConnector."""
    return aiohttp.TCPConnector(resolver=SourceResolver(server, port, source=source), use_dns_cache=False,
                                local_addr=(source, 0), **kwargs)
