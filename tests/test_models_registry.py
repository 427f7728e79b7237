"""model_type -> family (models/registry.py): the one list load, convert and info go through."""
import pytest

import minfer
from minfer.errors import ConfigError
from minfer.models.registry import MODEL_TYPES, model_class_of


def test_every_family_declares_its_model_types():
    assert set(MODEL_TYPES) == {"t5", "mt5", "umt5", "longt5", "transfo-xl"}
    for model_type in ("mt5", "umt5", "longt5"):
        assert model_class_of({"model_type": model_type}, "x") is minfer.T5Model
    assert model_class_of({}, "x") is minfer.T5Model  # old T5 saves omit model_type
    assert model_class_of({"model_type": "transfo-xl"}, "x") is minfer.XLModel


@pytest.mark.parametrize("model_type", ["bart", ["t5"], None, 5])
def test_unsupported_model_types_are_named(model_type):
    with pytest.raises(ConfigError, match=r"cfg.json: model_type .* is not supported \(supported: t5"):
        model_class_of({"model_type": model_type}, "cfg.json")


@pytest.mark.parametrize("architectures, model_type", [
    (["UMT5EncoderModel"], "umt5"), (["MT5ForConditionalGeneration"], "mt5"),
    (["T5EncoderModel"], "t5"), (None, "t5"), (["SomethingElse"], "t5")])
def test_a_config_without_model_type_is_read_by_its_architecture(architectures, model_type):
    from minfer.models.config import model_type_of
    from minfer.models.t5 import T5Config
    cfg = {} if architectures is None else {"architectures": architectures}
    assert model_type_of(cfg) == model_type
    assert model_class_of(cfg, "x") is minfer.T5Model
    parsed = T5Config.from_hf(cfg)
    assert parsed.model_type == model_type and parsed.bias_per_layer == (model_type == "umt5")


def test_a_model_type_that_is_given_wins_over_the_architecture():
    from minfer.models.config import model_type_of
    assert model_type_of({"model_type": "t5", "architectures": ["UMT5EncoderModel"]}) == "t5"
    with pytest.raises(ConfigError, match="not supported"):
        model_class_of({"architectures": ["TransfoXLLMHeadModel", "x"], "model_type": "xl"}, "c")


@pytest.mark.parametrize("model_type", ["x" * 5000, ["t5"] * 30000, {"t5": 1}, 10**400],
                         ids=["5000-char string", "30000-item list", "object", "10**400"])
def test_an_unsupported_model_type_is_quoted_cut_short(model_type):
    # the whole value was repr'd into the message: 5,000 characters for a 5,000-char model_type
    with pytest.raises(ConfigError) as e:
        model_class_of({"model_type": model_type}, "/m/config.json")
    msg = str(e.value)
    assert msg.startswith("/m/config.json: model_type ") and "supported: t5" in msg
    assert "\n" not in msg and len(msg) < 300
