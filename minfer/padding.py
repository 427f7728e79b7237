"""Token-id rows of different lengths as one right-padded (B, T) batch and its mask: what the
models' input checks (`models.base.as_batch`), `embed` and the pair scores hand to a model."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def right_padded(rows: Sequence[Sequence[int]], pad_id: int,
                 width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Checked token-id rows -> (B, width) int64 ids padded on the right with pad_id, and their
    0/1 int64 mask (width: the longest row when not given)."""
    ids = np.full((len(rows), width or max(len(row) for row in rows)), pad_id, np.int64)
    mask = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = row
        mask[r, :len(row)] = 1
    return ids, mask


def is_right_padding(mask: np.ndarray) -> bool:
    """Whether every row of a (B, T) 0/1 mask is ones, then zeros (what right_padded makes)."""
    lengths = mask.sum(axis=1)
    return not any(m[n:].any() for m, n in zip(mask, lengths))
