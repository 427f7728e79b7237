"""Lines of append-only files (JSON Lines), read in bounded pieces: the line reader, line counts,
and the resume point of a file written one line at a time.

Shared by the bulk commands (cli/bulk.py: their input rows and --resume) and the server's batch
jobs (serve/batch_runner.py: their input files and their output files' resume point). A writer
that appends each line whole, in order, can be killed at any moment: its file then holds complete
lines plus, at most, one line cut short at the end; `complete_lines` says where the complete ones
end, so a restarted writer cuts the rest and goes on from there, losing and repeating nothing.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Iterator

# A line longer than this is reported as None, read past in pieces, never held whole (json.loads
# of it would take ~10x its size).
MAX_LINE_BYTES = 16 << 20
# How much of a file is read at a time where lines are only counted
_CHUNK = 1 << 20


def lines(stream: BinaryIO) -> Iterator[tuple[int, int, bytes | None]]:
    r"""(line number from 1, byte offset of its start, its bytes without \n or \r\n) per line of
    a byte stream, read as it goes; None for a line over MAX_LINE_BYTES."""
    number = offset = 0
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if isinstance(line, str):   # a text stream without .buffer (an embedding program's)
            line = line.encode("utf-8", "surrogateescape")
        number += 1
        start, offset = offset, offset + len(line)
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while not line.endswith(b"\n"):   # read past the rest in bounded pieces
                line = stream.readline(_CHUNK)
                offset += len(line)
                if not line:
                    break
            yield number, start, None
            continue
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        yield number, start, line


def lines_left(f: BinaryIO) -> int:
    """Lines from a binary file's position to its end (a last one without a newline counts),
    read in bounded chunks."""
    count, last = 0, b"\n"
    while chunk := f.read(_CHUNK):
        count += chunk.count(b"\n")
        last = chunk[-1:]
    return count + (last != b"\n")


def count_lines(path: str | os.PathLike) -> int:
    """Lines of a file (a last one without a newline counts), read in bounded chunks."""
    with open(path, "rb") as f:
        return lines_left(f)


def complete_lines(path: str | os.PathLike) -> tuple[int, int]:
    """(newline-ended lines, the byte offset just after the last of them) of a file written a
    line at a time: its resume point (no file: (0, 0)). What follows that offset is a line cut
    short by a writer that was stopped mid-write."""
    count = end = offset = 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0, 0
    with f:
        while chunk := f.read(_CHUNK):
            newlines = chunk.count(b"\n")
            if newlines:
                count += newlines
                end = offset + chunk.rindex(b"\n") + 1
            offset += len(chunk)
    return count, end
