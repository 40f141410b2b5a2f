"""Whether coding blocks pays on this disk and these cores (``kv.ssd_codec = "auto"``).

Coding a block pays end to end (written once, read back once) when the disk time it saves is
more than its coding costs. For a block of ``n`` payload bytes stored ``n / ratio``::

    (write_per_byte + read_per_byte) * (1 - 1 / ratio) > encode_per_byte + decode_per_byte

where ``write_per_byte`` and ``read_per_byte`` are the seconds an I/O thread waits per byte
written to or read from the disk, and ``encode_per_byte`` and ``decode_per_byte`` the seconds it
spends per payload byte coding, all measured on the tier's own threads under the load they see:
a fast NVMe drive makes the disk cheaper than the codec, and coding stops; a slow or busy disk
makes it pay. The ratio is measured on the blocks coded.

Until a coded block has been read back (a tier that is mostly written), the read terms are
unknown and the decision goes by the write's alone: disk seconds saved writing against encoding.

While coding does not pay, one block in :data:`SAMPLE_EVERY` is still coded (a few percent of
the writes), so the ratio and the decode cost stay measured and coding starts again when the
disk slows. Before anything is measured, blocks are coded (the probe that measures). The
decision flips only past a margin (:data:`HYSTERESIS`), so noise near the break-even does not
flip it at every block. Measurements are moving averages (:data:`WEIGHT` each new one).

No I/O, no clock of its own: the tier times its reads and decodes and reports them here. Safe
to call from the tier's I/O threads (the worst a race does is lose one sample).
"""

from __future__ import annotations

__all__ = ["CodecChoice", "HYSTERESIS", "SAMPLE_EVERY", "WEIGHT"]

SAMPLE_EVERY = 32
HYSTERESIS = 1.2         # the saving must beat the cost by this factor to start coding, and fall below 1/it to stop
WEIGHT = 0.05


class CodecChoice:
    """The decision of the module, from what :meth:`read`, :meth:`decoded` and :meth:`encoded`
    report."""

    def __init__(self) -> None:
        self.read_per_byte: float | None = None      # seconds an I/O thread waits per byte read
        self.write_per_byte: float | None = None     # ... per byte written (and synced)
        self.encode_per_byte: float | None = None    # seconds per payload byte encoded
        self.decode_per_byte: float | None = None    # ... decoded
        self.ratio: float | None = None              # payload bytes / stored bytes of coded blocks
        self.coding = True                           # the last decision (True until measured otherwise)
        self._count = 0

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else old + WEIGHT * (new - old)

    def read(self, nbytes: int, seconds: float) -> None:
        """An I/O thread read ``nbytes`` from the disk in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self.read_per_byte = self._average(self.read_per_byte, seconds / nbytes)

    def wrote(self, nbytes: int, seconds: float) -> None:
        """An I/O thread wrote (and synced) ``nbytes`` to the disk in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self.write_per_byte = self._average(self.write_per_byte, seconds / nbytes)

    def decoded(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` of payload were decoded in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self.decode_per_byte = self._average(self.decode_per_byte, seconds / nbytes)

    def encoded(self, nbytes: int, stored: int | None, seconds: float) -> None:
        """A payload of ``nbytes`` was coded to ``stored`` bytes in ``seconds`` (None: it did
        not shrink enough, and is stored raw: counted as no gain)."""
        if nbytes > 0:
            self.ratio = self._average(self.ratio, nbytes / (stored if stored else nbytes))
            if seconds > 0:
                self.encode_per_byte = self._average(self.encode_per_byte, seconds / nbytes)

    def saving_over_cost(self) -> float | None:
        """Disk seconds saved per byte / coding seconds per byte, a block written and read once;
        the write's alone until a coded block has been read (None: not even that measured yet)."""
        read, write, ratio = self.read_per_byte, self.write_per_byte, self.ratio
        encode, decode = self.encode_per_byte, self.decode_per_byte
        if write is None or ratio is None or encode is None:
            return None
        kept = 1.0 - 1.0 / max(ratio, 1.0)
        if read is None or decode is None:
            return write * kept / encode
        return (read + write) * kept / (encode + decode)

    def code_next(self) -> bool:
        """Whether to code the next block written."""
        value = self.saving_over_cost()
        if value is not None:
            if self.coding and value < 1.0 / HYSTERESIS:
                self.coding = False
            elif not self.coding and value > HYSTERESIS:
                self.coding = True
        self._count += 1
        return self.coding or self._count % SAMPLE_EVERY == 0
