"""Weights: declared per family, checked, formatted, planned, placed, and streamed when needed.

- table.py     the vocabulary of a family's weight table (Linear, Tensor, Derived, View)
- formats.py   how linear slots are stored (float32, float16, int8) and multiplied
- layout.py    one layer's packed byte layout
- planner.py   which layers stay resident under a memory limit (pure)
- loader.py    check -> fuse/fold -> format -> plan -> place, once for every family
- runtime.py   placed layers as the math sees them; streaming one ahead through two slots
- transfers.py where streamed bytes live on the CPU and the thread that copies them in
"""
