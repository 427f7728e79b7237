"""Transformer-XL's declaration (models/transfo_xl/config.py, weights.py): config checks and the
weight table."""
import pytest
from test_t5_spec import cases

from minfer.errors import ConfigError
from minfer.models.config import MAX_COUNT, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH
from minfer.models.transfo_xl.config import XLConfig
from minfer.models.transfo_xl.weights import r_table_rows, weight_table
from minfer.params.table import Linear, Tensor, View

BASE = {"model_type": "transfo-xl", "vocab_size": 40, "cutoffs": [10, 20], "d_model": 8,
        "d_embed": 8, "n_head": 2, "d_head": 4, "d_inner": 16, "n_layer": 2, "div_val": 2,
        "mem_len": 6, "tgt_len": 4, "clamp_len": 5}


@pytest.mark.parametrize("change,needle", [
    ({"cutoffs": [20, 10]}, "'cutoffs'"), ({"cutoffs": [10, 40]}, "'cutoffs'"),
    ({"tie_projs": [True]}, "'tie_projs' must be a list of 3 JSON booleans"), ({"d_model": 7}, "'d_model' must be even"),
    ({"attn_type": 1}, "attn_type 1"), ({"eos_token_id": 40}, "'eos_token_id'"),
    ({"model_type": "t5"}, "not transfo-xl"), ({"clamp_len": 1.5}, "'clamp_len'"),
])
def test_config_errors_name_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        XLConfig.from_hf({**BASE, **change})


XL_KEYS = {  # every scalar key XLConfig.from_hf reads: kind, lower bound, cap (ids: vocab 40)
    "vocab_size": ("int", 1, MAX_VOCAB), "d_model": ("int", 1, MAX_WIDTH),
    "d_embed": ("int", 1, MAX_WIDTH), "n_head": ("int", 1, MAX_COUNT),
    "d_head": ("int", 1, MAX_WIDTH), "d_inner": ("int", 1, MAX_WIDTH),
    "div_val": ("int", 1, MAX_WIDTH), "n_layer": ("int", 1, MAX_COUNT),
    "mem_len": ("int", 0, MAX_LENGTH), "tgt_len": ("int", 1, MAX_LENGTH),
    "clamp_len": ("int", -MAX_LENGTH, MAX_LENGTH), "attn_type": ("int", 0, 3),
    "same_length": ("bool", 0, 0), "pre_lnorm": ("bool", 0, 0), "untie_r": ("bool", 0, 0),
    "tie_word_embeddings": ("bool", 0, 0), "proj_share_all_but_first": ("bool", 0, 0),
    "model_type": ("str", 0, 0), "eos_token_id": ("id", 0, 40), "layer_norm_epsilon": ("eps", 0, 0),
}
LISTS = {  # the list-valued keys: wrong containers, wrong entries, wrong lengths / order
    "cutoffs": ["10,20", None, {"a": 10}, [10, "20"], [10.0, 20], [True, 20], [10, 2**63],
                [10, 10**400], [20, 10], [10, 10], [0, 10], [10, 40]],
    "tie_projs": ["true", None, [False, "true", True], [0, 1, 1], [False, True, 1.0], [True],
                  [False, True, True, True], [[True], True, True]],
    "eos_token_id": [[], [0, "1"], [True]],
}


@pytest.mark.parametrize("key,value", cases(XL_KEYS) + [
    pytest.param(k, v, id=f"{k}={v!r:.30}") for k, vs in LISTS.items() for v in vs])
def test_every_key_is_strictly_typed(key, value):
    with pytest.raises(ConfigError) as e:
        XLConfig.from_hf({**BASE, key: value}, "/m/config.json")
    msg = str(e.value)
    assert msg.startswith("/m/config.json: ") and key in msg and "\n" not in msg and len(msg) < 300


def test_booleans_are_read_as_written():
    """"false" was read as true: the strings are refused above; real booleans keep their value."""
    cfg = XLConfig.from_hf({**BASE, "same_length": False, "pre_lnorm": True, "untie_r": False,
                            "tie_word_embeddings": False, "tie_projs": [False, False, True]})
    assert (cfg.same_length, cfg.pre_lnorm, cfg.untie_r, cfg.tie_word_embeddings,
            cfg.tie_projs) == (False, True, False, False, (False, False, True))
    assert XLConfig.from_hf({**BASE, "proj_share_all_but_first": False}).tie_projs == (False,) * 3
    assert XLConfig.from_hf({**BASE, "eos_token_id": [3, 0]}).eos_token_id == 3


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
