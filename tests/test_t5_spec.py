"""T5's declaration (models/t5/spec.py): config parsing."""
import numpy as np
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


def test_weight_table_fuses_folds_and_splits_the_cross_projections():
    from minfer.models.t5.spec import weight_table
    from minfer.params.spec import Linear, Tensor, View
    cfg = t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu"})
    table = weight_table(cfg)
    C, I, F, V = cfg.d_model, cfg.inner, cfg.d_ff, cfg.vocab_size
    assert list(table.stacks) == ["encoder", "cross", "decoder"]
    assert [len(s) for s in table.stacks.values()] == [2, 2, 2]
    dec = table.stacks["decoder"][1]
    assert dec["w_qkv"] == Linear(tuple(f"decoder.block.1.layer.0.SelfAttention.{w}.weight"
                                        for w in "qkv"))
    assert dec["ln_self"] == Tensor("decoder.block.1.layer.0.layer_norm.weight")
    assert {n: table.shape(e) for n, e in dec.items()} == {            # (out, in)
        "w_qkv": (3 * I, C), "w_o": (C, I), "w_cross_q": (I, C), "w_cross_o": (C, I),
        "w_in": (2 * F, C), "w_out": (C, F), "ln_self": (C,), "ln_cross": (C,), "ln_ff": (C,)}
    assert table.shape(table.stacks["cross"][0]["w_cross_kv"]) == (2 * I, C)
    # a tied head: one (V, C) slot whose rows are the embedding
    assert table.fixed["lm_head"] == Linear(("shared.weight",))
    assert table.fixed["embedding"] == View("lm_head") and table.shape(table.fixed["embedding"]) == (V, C)
    untied = weight_table(t5.T5Config.from_hf({**BASE, "tie_word_embeddings": False}))
    assert untied.fixed["embedding"] == Linear(("shared.weight",))
    assert untied.fixed["lm_head"] == Linear(("lm_head.weight",))
    # int8 quantises exactly the matrices: every 2-D tensor but the position-bias tables
    matrices = {n for n, s in table.tensors.items() if len(s) == 2 and "relative_attention" not in n}
    assert table.linear_sources() == matrices
    assert table.priority == {"decoder": 1}


def test_parameter_count_is_every_checkpoint_tensor():
    from minfer.models.t5.spec import weight_table
    cfg = t5.T5Config.from_hf(BASE)
    C, I, F, V, L = 16, 16, 32, 64, 2
    per_enc = 4 * C * I + 2 * C * F + 2 * C
    per_dec = 8 * C * I + 2 * C * F + 3 * C
    want = V * C + L * (per_enc + per_dec) + 2 * (8 * 4 + C)
    assert weight_table(cfg).parameter_count() == want


def test_buffer_sets_allocate_exactly_what_they_count():
    from minfer.arena import Arena, align_up
    from minfer.models.t5.spec import DecodeBuffers, DecoderScratch, EncoderScratch, run_bytes
    cfg = t5.T5Config.from_hf(BASE)
    arena = Arena("8MiB")
    for cls, args in ((EncoderScratch, (cfg, 2, 7, np.float32)),
                      (DecoderScratch, (cfg, 2, 5, 7, np.float32)),
                      (DecodeBuffers, (cfg, 3, 7, 20, np.float32))):
        with arena.scope():
            buf = cls.allocate(arena, *args)
            assert align_up(arena.used) == cls.nbytes(*args)  # the last block is not padded
            assert set(cls.specs(*args)) == {k for k, v in vars(buf).items() if v is not None}
    buf = DecodeBuffers.allocate(arena, cfg, 3, 7, 20, np.float32)
    live = buf.rows(2)  # views of the first two rows, sharing memory
    assert live.self_k.shape == (2, 2, 4, 20, 4) and live.x.shape == (2, 1, 16)
    assert np.shares_memory(live.self_k, buf.self_k) and live.scores is buf.scores
    plan = run_bytes(cfg, np.float32, 3, 7, 20)
    assert plan["decode_state"] == DecodeBuffers.nbytes(cfg, 3, 7, 20, np.float32)
    assert plan["peak"] == plan["decode_state"] + max(plan["encoder_scratch"], plan["cross_kv_scratch"])
