"""Types of the C extension kvcached/codecs/_planes.c (see kvcached/codecs/planes.py)."""

from typing import Sequence

from typing_extensions import Buffer

def split(src: Buffer, width: int) -> bytes: ...
def merge(planes: Sequence[Buffer], width: int, out: Buffer) -> None: ...
