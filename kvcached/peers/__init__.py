"""The peer tier: daemons pull blocks from each other (docs/peer-protocol.md, docs/peers.md).

``protocol`` is the sans-I/O frame codec; the transports (QUIC now, maybe TLS over TCP later)
are thin layers under it.
"""
