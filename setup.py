"""The daemon's compiled parts: two small C extensions, built by ``pip install`` (make install)
with the system's C compiler and Python's headers. kvcached/host/_short_hash.c hashes short
inputs many at a time (BLAKE3); kvcached/codecs/_planes.c splits blocks into byte planes and
merges them back (the planes-zstd codec). Both are optional: where they cannot be built the daemon
does the same work through the blake3 package (kvcached/host/short_hash.py) and numpy
(kvcached/codecs/planes.py), only slower. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvcached.host._short_hash", ["kvcached/host/_short_hash.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c99"]),
                   Extension("kvcached.codecs._planes", ["kvcached/codecs/_planes.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"])])     # -O3: gcc vectorises the byte loops
