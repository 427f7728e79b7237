"""The activations' constants, declared once: ops.py's array activations and the compiled ones
(activations.py, vector_math.py) read them. Plain Python: importing it loads no numba."""

from __future__ import annotations

import math

# GELU, tanh approximation ('gelu_new'): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715

# erf(a) = 1 - t (A1 + t (A2 + t (A3 + t (A4 + t A5)))) e^(-a^2), t = 1 / (1 + P a), a >= 0:
# Abramowitz & Stegun 7.1.26, |error| < 1.5e-7 (below float32's noise in a GELU)
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)     # A1 .. A5
