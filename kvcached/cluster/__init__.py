"""A cluster of daemons: membership (etcd) and where blocks are (their home nodes).

Sans-I/O logic (:mod:`.member`, :mod:`.view`, :mod:`.placement`, :mod:`.location`) with the
clock passed in; :mod:`.etcd` is the thin asyncio layer that keeps the membership in etcd.
docs/cluster.md has the design and the figures.
"""
