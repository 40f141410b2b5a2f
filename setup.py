"""The daemon's compiled part: one small C extension (kvcached/host/_short_hash.c, BLAKE3 of
short inputs many at a time), built by ``pip install`` (make install) with the system's C
compiler and Python's headers. It is optional: where it cannot be built the daemon runs the
same hashes through the blake3 package (kvcached/host/short_hash.py), only slower. Everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvcached.host._short_hash", ["kvcached/host/_short_hash.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c99"])])
