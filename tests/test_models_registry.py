"""model_type -> family (models/registry.py): the one list load, convert and info go through."""
import pytest

import minfer
from minfer.errors import ConfigError
from minfer.models.registry import MODEL_TYPES, family_of


def test_every_family_declares_its_model_types():
    assert set(MODEL_TYPES) == {"t5", "mt5", "longt5", "transfo-xl"}
    assert family_of({"model_type": "mt5"}, "x") is minfer.T5Model
    assert family_of({"model_type": "longt5"}, "x") is minfer.T5Model
    assert family_of({}, "x") is minfer.T5Model  # old T5 saves omit model_type
    assert family_of({"model_type": "transfo-xl"}, "x") is minfer.XLModel


@pytest.mark.parametrize("model_type", ["bart", ["t5"], None, 5])
def test_unsupported_model_types_are_named(model_type):
    with pytest.raises(ConfigError, match=r"cfg.json: model_type .* is not supported \(supported: t5"):
        family_of({"model_type": model_type}, "cfg.json")
