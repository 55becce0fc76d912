"""DNS as users run it: one service name answered per region.

- bench/dns/bind.py: BIND 9 on this machine with one view per region (``skylb local --dns``, the tests).
- bench/dns/resolver.py: an aiohttp resolver that asks as one region's clients do (from their source address).
- controller/dns.py: the controller's side, RFC 2136 updates that point one region's view at a balancer; its
  settings (server, zone, name, one TSIG key per region) are skylb/dns_settings.py's.
"""
