"""model_type -> family: the one list of the model families minfer runs.

`load`, `convert` and `info` reach the families only through here.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..io.limits import shown
from .base import Model
from .config import model_type_of
from .t5 import T5Model
from .transfo_xl import XLModel

FAMILIES: tuple[type[Model], ...] = (T5Model, XLModel)
MODEL_TYPES: dict[str, type[Model]] = {t: f for f in FAMILIES for t in f.spec.model_types}


def family_of(config: dict, source: str) -> type[Model]:
    """The family class that reads a config.json (model_type absent: the one `architectures`
    names, else T5, as old T5 saves omit both)."""
    model_type = model_type_of(config)
    family = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"{source}: model_type {shown(model_type)} is not supported "
                          f"(supported: {', '.join(MODEL_TYPES)})")
    return family
