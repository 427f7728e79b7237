"""Where a streamed layer's bytes live on the CPU, and the engine that copies them into a slot.

`PackFile` keeps streamed layers in an unlinked temporary file read back with `pread`; `Transfers`
runs those copies on a background thread so the next layer arrives while this one computes. The
CUDA backend swaps in its own engine (pinned memory, a copy stream and events, see cuda.py) with
the same `issue` / `wait` / `slot_released` / `close` interface, and tests swap in a counting
stand-in: the scheduling in runtime.py is the same code on every device.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StreamingError


class PackFile:
    """Streamed layers of a CPU run, packed in an unlinked temporary file and read back with
    `pread` straight into an arena slot: no memory map, so the page cache, not the process,
    holds them (`TMPDIR` chooses the disk; on a tmpfs they would sit in RAM after all)."""

    def __init__(self) -> None:
        self.where = os.environ.get("TMPDIR") or tempfile.tempdir or "the temporary directory"
        try:
            self.where = tempfile.gettempdir()
            self._file = tempfile.TemporaryFile(prefix="minfer-layers-")
        except OSError as e:
            raise self._error("cannot create", e) from None
        self.size = 0

    def _error(self, what: str, e: Exception) -> StreamingError:
        return StreamingError(f"{what} the file of streamed layers in {self.where} (set TMPDIR "
                              f"to a disk with room): {e}")

    def append(self, block: np.ndarray) -> tuple[int, int]:
        offset = self.size
        try:
            self._file.seek(offset)
            self._file.write(memoryview(block))
            self._file.flush()
        except OSError as e:
            raise self._error("cannot write", e) from None
        self.size = offset + block.nbytes
        return offset, block.nbytes

    def read_into(self, dst: np.ndarray, offset: int, nbytes: int) -> None:
        view = memoryview(dst)[:nbytes]
        done = 0
        try:
            fd = self._file.fileno()
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"short read at byte {offset + done}")
                done += got
        except (OSError, ValueError) as e:  # ValueError: the file was closed (model closed)
            raise self._error("cannot read", e) from None

    def close(self) -> None:
        self._file.close()


@dataclass
class HostSource:
    """A streamed layer's packed bytes: an array in host memory, or a region of a PackFile."""
    nbytes: int
    array: np.ndarray | None = None
    pack: PackFile | None = None
    offset: int = 0

    def copy_into(self, dst: np.ndarray) -> None:
        if self.array is not None:
            np.copyto(dst[:self.nbytes], self.array)
        else:
            self.pack.read_into(dst, self.offset, self.nbytes)


class Transfers:
    """Host -> arena copies on a background thread (the CPU backend's transfer engine).

    `issue` starts a copy and returns a ticket; `wait` blocks until it is done. NumPy copies and
    `pread` release the GIL, so the next layer's bytes arrive while this layer's BLAS calls run."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minfer-prefetch")
        self._pid = os.getpid()

    def issue(self, source: HostSource, slot: Any, unit: str, slot_index: int = 0) -> Any:
        if self._pid != os.getpid():
            # a forked child: the pool's thread stayed in the parent, and the pool would wait
            # for it forever; this process gets its own (the pack file is read by offset, so
            # sharing its descriptor is safe)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minfer-prefetch")
            self._pid = os.getpid()
        return self._pool.submit(source.copy_into, slot)

    def wait(self, ticket: Any) -> None:
        ticket.result()

    def slot_released(self, slot_index: int) -> None:
        """The compute that read a slot has been queued (CUDA records an event here)."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
