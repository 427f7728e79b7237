"""NaN and infinity in a model's outputs: the check every public call makes on what it hands
back, and how the layer where they began is found.

Weights can load and still overflow (a float16 copy of a checkpoint trained in bfloat16, a
corrupted scale): the outputs then hold NaN or infinity, which NumPy only warns about and JSON
cannot carry. minfer checks each call's outputs once, on the host copy it hands back (one
reduction over them: far less than the call's own work, and no extra device sync) and, when they
are not finite, raises `NonFiniteError` naming the model and the first layer whose output was
not finite. Finding that layer is only done on the failing path: a pure pass (the encoder) is
run again with a probe after every layer; a decode step reads its own KV caches, which hold
each layer's projection of that layer's input (so a layer whose own key projection overflows
is named with the layer before it: the message says both).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .errors import NonFiniteError

Probe = Callable[..., None]   # probe(label, *arrays): called after each layer of a probed pass


def quiet() -> Any:
    """NumPy's floating-point warnings off for a model call: overflow there is found by the
    check of its outputs and raised as one NonFiniteError, not printed along the way."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def all_finite(xp: Any, *arrays: Any) -> bool:
    """Whether every value of the arrays is finite (None entries are skipped). One float32 sum
    each: NaN or infinity anywhere makes the sum non-finite; a non-finite float32 sum is summed
    again in float64, which cannot overflow on finite float32 or float16 values (so huge finite
    values are not taken for infinity). float32 first, as it reads the array at about twice
    float64's speed; NumPy and CuPy reduce in blocks, with no array-sized temporary."""
    for a in arrays:
        if a is None or not a.size:
            continue
        with quiet():   # (inf + -inf is NaN: no "invalid value" warning for what it finds)
            if _finite(xp.sum(a, dtype=xp.float32)):
                continue
            if not _finite(xp.sum(a, dtype=xp.float64)):
                return False
    return True


def _finite(total: Any) -> bool:
    """A sum's value is finite (a device sum read back with .get(), CuPy's documented sync)."""
    return math.isfinite(float(total.get() if hasattr(total, "get") else total))


class _Found(Exception):
    def __init__(self, label: str):
        super().__init__(label)
        self.label = label


def first_non_finite(xp: Any, run: Callable[[Probe], Any]) -> str | None:
    """Run `run(probe)` (a pass that calls probe(label, *arrays) after each of its layers) and
    return the label of the first layer whose arrays are not all finite, or None."""
    def probe(label: str, *arrays: Any) -> None:
        if not all_finite(xp, *arrays):
            raise _Found(label)
    try:
        run(probe)
    except _Found as found:
        return found.label
    return None


def first_bad_layer(xp: Any, per_layer: Any, layers: int, stack: str = "") -> str:
    """Where NaN or infinity began in a call, from arrays each layer wrote from its own input
    (`per_layer[i]`: layer i's cached keys of a step's position, or its memory of a segment):
    the first layer whose array is not finite was fed by the layer before it; when every one is
    finite, the last layer or the head that follows it. `stack`: "decoder " or ""."""
    for i in range(layers):
        if not all_finite(xp, per_layer[i]):
            into = f" (or {stack}layer {i}'s key projection)"
            return (f"{stack}embedding" if i == 0 else f"{stack}layer {i - 1}") + into
    return f"{stack}layer {layers - 1} or the output head"


def non_finite(model: Any, outputs: str, where: str | None) -> NonFiniteError:
    """The one-line error of a call whose `outputs` hold NaN or infinity."""
    dtype = getattr(getattr(model, "backend", None), "dtype", None)
    began = f", beginning at {where}" if where else ""
    hint = (" (its weights or activations overflow in float16: try dtype='float32' or "
            "'bfloat16')" if str(dtype) == "float16" else " (its weights overflow or are corrupt)")
    return NonFiniteError(f"model {getattr(model, 'folder', model)}: the {outputs} hold NaN or "
                          f"infinity{began}{hint}")
