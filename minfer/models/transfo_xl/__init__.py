"""Transformer-XL (transfo-xl-wt103): config.py, weights.py and buffers.py declare it (family.py's
Family ties them together), math.py computes it, model.py serves it."""

from .model import SegmentMemory, XLDecodeState, XLModel, XLSession
from .config import XLConfig

__all__ = ["XLConfig", "XLModel", "XLSession", "SegmentMemory", "XLDecodeState"]
