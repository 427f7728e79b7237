"""Transformer-XL's declaration (models/transfo_xl/spec.py): config checks and the weight table."""
import pytest

from minfer.errors import ConfigError
from minfer.models.transfo_xl.spec import XLConfig, r_table_rows, weight_table
from minfer.params.spec import Linear, Tensor, View

BASE = {"model_type": "transfo-xl", "vocab_size": 40, "cutoffs": [10, 20], "d_model": 8,
        "d_embed": 8, "n_head": 2, "d_head": 4, "d_inner": 16, "n_layer": 2, "div_val": 2,
        "mem_len": 6, "tgt_len": 4, "clamp_len": 5}


@pytest.mark.parametrize("change,needle", [
    ({"cutoffs": [20, 10]}, "'cutoffs'"), ({"cutoffs": [10, 40]}, "'cutoffs'"),
    ({"tie_projs": [True]}, "'tie_projs' must list 3"), ({"d_model": 7}, "'d_model' must be even"),
    ({"attn_type": 1}, "attn_type 1"), ({"eos_token_id": 40}, "'eos_token_id'"),
    ({"model_type": "t5"}, "not transfo-xl"), ({"clamp_len": 1.5}, "'clamp_len'"),
])
def test_config_errors_name_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        XLConfig.from_hf({**BASE, **change})


def test_tied_tensors_are_read_from_their_source_and_their_copies_are_optional():
    cfg = XLConfig.from_hf({**BASE, "tie_projs": [False, True, True], "untie_r": False})
    table = weight_table(cfg)
    assert "crit.out_layers.1.weight" in table.optional                  # tied to the embedding
    assert table.fixed["cluster.1.w"] == Linear(("transformer.word_emb.emb_layers.1.weight",))
    assert table.fixed["emb_table.1"] == View("cluster.1.w")             # one slot, both uses
    assert table.fixed["cluster.1.proj"] == Linear(("transformer.word_emb.emb_projs.1",),
                                                   transpose=True)
    assert table.fixed["cluster.0.proj"] == Linear(("crit.out_projs.0",), transpose=True)
    assert table.shape(table.fixed["cluster.1.proj"]) == (4, 8)           # (d_1, C)
    assert table.shape(table.fixed["emb_proj.1"]) == (8, 4)               # (C, d_1)
    # cluster 0 also scores the tail clusters: their logit rows come after its own
    assert table.shape(table.fixed["cluster.0.w"]) == (10 + 2, 8)
    assert table.shape(table.fixed["cluster.0.b"]) == (12,)
    layer = table.stacks["layers"][1]
    assert layer["r_w_bias"] == Tensor("transformer.r_w_bias")           # one pair for all layers
    assert "transformer.layers.1.dec_attn.r_w_bias" in table.optional
    assert table.shape(table.fixed["r_table.0"]) == (r_table_rows(cfg), 8) == (6, 8)  # clamp_len+1
    assert table.buffers == ("transformer.pos_emb.inv_freq",)
