"""T5 (v1.0, v1.1 / flan-t5, mT5): config.py, weights.py and buffers.py declare it (family.py's
Family ties them together), math.py computes it, model.py serves it."""

from .model import T5DecodeState, T5Model
from .config import T5Config

__all__ = ["T5Config", "T5Model", "T5DecodeState"]
