"""T5 (v1.0, v1.1 / flan-t5, mT5): spec.py declares it, math.py computes it, model.py serves it."""

from .model import T5DecodeState, T5Model
from .spec import T5Config

__all__ = ["T5Config", "T5Model", "T5DecodeState"]
