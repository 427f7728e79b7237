"""Transformer-XL (transfo-xl-wt103): spec.py declares it, math.py computes it, model.py serves it."""

from .model import SegmentMemory, XLDecodeState, XLModel, XLSession
from .spec import XLConfig

__all__ = ["XLConfig", "XLModel", "XLSession", "SegmentMemory", "XLDecodeState"]
