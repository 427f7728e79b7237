"""T5's declaration (models/t5/spec.py): config parsing."""
import pytest
from factories import BASE

from minfer.errors import ConfigError
from minfer.models import t5


def test_config_variants():
    gated = t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu"})
    assert gated.gated and gated.act == "gelu_new"
    explicit = t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"})
    assert explicit.act == "gelu"
    assert t5.T5Config.from_hf({**BASE, "num_decoder_layers": None}).num_decoder_layers == 2
    assert t5.T5Config.from_hf({k: v for k, v in BASE.items()
                                if k != "decoder_start_token_id"}).decoder_start_token_id == 0


@pytest.mark.parametrize("change,needle", [
    ({"d_model": 0}, "'d_model'"), ({"num_heads": "8"}, "'num_heads'"),
    ({"feed_forward_proj": "gated-"}, "feed_forward_proj"),
    ({"feed_forward_proj": "fancy-gelu"}, "feed_forward_proj"),
    ({"dense_act_fn": "mish"}, "activation 'mish'"), ({"model_type": "bart"}, "model_type"),
    ({"eos_token_id": 999}, "eos_token_id"), ({"relative_attention_max_distance": 16, "relative_attention_num_buckets": 32}, "max_distance"),
])
def test_config_errors_name_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        t5.T5Config.from_hf({**BASE, **change})
