"""model_type -> model class: the one list of the model families minfer runs (each class's
`family` is its declaration).

`load`, `convert` and `info` reach the families only through here.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..io.limits import shown
from .base import Model
from . import config
from .config import model_type_of
from .t5 import T5Model
from .transfo_xl import XLModel

MODEL_CLASSES: tuple[type[Model], ...] = (T5Model, XLModel)
MODEL_TYPES: dict[str, type[Model]] = {t: c for c in MODEL_CLASSES for t in c.family.model_types}


def register(model_class: type[Model], architectures: tuple[tuple[str, str], ...] = ()) -> None:
    """Make `load`, `convert` and `info` read the model types a family declares with this class
    (a family outside this tree; the tree's own are in MODEL_CLASSES), and configs without
    model_type whose architecture name starts with a prefix in `architectures` ((prefix,
    model_type) pairs) as one of them."""
    for model_type in model_class.family.model_types:
        MODEL_TYPES[model_type] = model_class
    config.ARCHITECTURE_TYPES[:0] = architectures


def model_class_of(config: dict, source: str) -> type[Model]:
    """The model class that reads a config.json (model_type absent: the one `architectures`
    names, else T5, as old T5 saves omit both)."""
    model_type = model_type_of(config)
    model_class = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if model_class is None:
        raise ConfigError(f"{source}: model_type {shown(model_type)} is not supported "
                          f"(supported: {', '.join(MODEL_TYPES)})")
    return model_class
