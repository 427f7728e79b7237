"""T5's declaration (models/t5/config.py, weights.py, buffers.py): config parsing."""
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


# -- strict types: every key the parser reads, every way JSON can get it wrong ---------------------
def bad_values(kind, low=1, cap=None):
    """Values a config.json key of this kind must refuse: (label, value) pairs, generated from
    the kind (a JSON int, a JSON bool, a string, a token id, a small float) and its bounds."""
    other_types = [("str", "8"), ("list", ["8"]), ("object", {"v": 8}), ("null", None)]
    if kind == "int":
        return other_types + [("bool", True), ("float", 8.0), ("below", low - 1),
                              ("above cap", cap + 1), ("2**63", 2**63), ("10**400", 10**400),
                              ("nan", float("nan")), ("inf", float("inf"))]
    if kind == "bool":
        return [("str false", "false"), ("str true", "true"), ("int 0", 0), ("int 1", 1),
                ("float", 1.0), ("list", [True]), ("null", None)]
    if kind == "str":
        return [("list", ["relu"]), ("int", 5), ("bool", True), ("object", {}), ("null", None)]
    if kind == "id":
        return other_types + [("bool true", True), ("bool false", False), ("float", 1.0),
                              ("negative", -1), ("vocab_size", cap), ("2**63", 2**63),
                              ("10**400", 10**400)]
    if kind == "eps":
        return [("str", "1e-6"), ("bool", True), ("one", 1.0), ("negative", -1e-6),
                ("10**400", 10**400), ("nan", float("nan")), ("inf", float("inf")), ("null", None)]
    raise AssertionError(kind)


def cases(keys):
    """pytest params (key, value) over a {key: (kind, low, cap)} table."""
    return [pytest.param(key, value, id=f"{key}={label}")
            for key, (kind, low, cap) in keys.items() for label, value in bad_values(kind, low, cap)]


from minfer.models.config import MAX_COUNT, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH  # noqa: E402

T5_KEYS = {  # every key T5Config.from_hf reads: kind, lower bound, cap (ids: BASE's vocab_size)
    "vocab_size": ("int", 1, MAX_VOCAB), "d_model": ("int", 1, MAX_WIDTH),
    "d_kv": ("int", 1, MAX_WIDTH), "d_ff": ("int", 1, MAX_WIDTH),
    "num_heads": ("int", 1, MAX_COUNT), "num_layers": ("int", 1, MAX_COUNT),
    "relative_attention_num_buckets": ("int", 2, MAX_COUNT),
    "relative_attention_max_distance": ("int", 2, MAX_LENGTH),
    "tie_word_embeddings": ("bool", 0, 0), "is_gated_act": ("bool", 0, 0),
    "model_type": ("str", 0, 0), "feed_forward_proj": ("str", 0, 0), "dense_act_fn": ("str", 0, 0),
    "pad_token_id": ("id", 0, 64), "eos_token_id": ("id", 0, 64),
    "layer_norm_epsilon": ("eps", 0, 0),
}
# nullable keys: null means "the default" (HF writes it); every other bad value is still refused
T5_NULLABLE = {"num_decoder_layers": ("int", 1, MAX_COUNT), "decoder_start_token_id": ("id", 0, 64)}


@pytest.mark.parametrize("key,value", cases(T5_KEYS) + [
    p for p in cases(T5_NULLABLE) if p.values[1] is not None])
def test_every_key_is_strictly_typed(key, value):
    with pytest.raises(ConfigError) as e:
        t5.T5Config.from_hf({**BASE, key: value}, "/m/config.json")
    msg = str(e.value)
    assert msg.startswith("/m/config.json: ") and key in msg and "\n" not in msg and len(msg) < 300


@pytest.mark.parametrize("key,cap", [("d_model", MAX_WIDTH), ("vocab_size", MAX_VOCAB),
                                     ("num_layers", MAX_COUNT)])
def test_caps_are_inclusive_and_stated(key, cap):
    assert getattr(t5.T5Config.from_hf({**BASE, key: cap}), key) == cap  # parsing allocates nothing
    with pytest.raises(ConfigError, match=f"'{key}' must be an integer in 1..{cap}, got {cap + 1}"):
        t5.T5Config.from_hf({**BASE, key: cap + 1})


def test_nullable_keys_take_their_default_and_ids_lists():
    cfg = t5.T5Config.from_hf({**BASE, "num_decoder_layers": None, "decoder_start_token_id": None,
                               "pad_token_id": 3, "eos_token_id": [1, 2]})
    assert (cfg.num_decoder_layers, cfg.decoder_start_token_id, cfg.eos_token_ids) == (2, 3, (1, 2))
    for eos in ([], [1, True], [1, 64], [1, "2"]):
        with pytest.raises(ConfigError, match="'eos_token_id'"):
            t5.T5Config.from_hf({**BASE, "eos_token_id": eos})
    for proj, gated, act in (("gated-silu", True, "silu"), ("relu", False, "relu")):
        cfg = t5.T5Config.from_hf({**BASE, "feed_forward_proj": proj})
        assert (cfg.gated, cfg.act) == (gated, act)
    assert not t5.T5Config.from_hf({**BASE, "feed_forward_proj": "gated-gelu",
                                    "is_gated_act": False}).gated


def test_weight_table_fuses_folds_and_splits_the_cross_projections():
    from minfer.models.t5.weights import weight_table
    from minfer.params.table import Linear, Tensor, View
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
    from minfer.models.t5.weights import weight_table
    cfg = t5.T5Config.from_hf(BASE)
    C, I, F, V, L = 16, 16, 32, 64, 2
    per_enc = 4 * C * I + 2 * C * F + 2 * C
    per_dec = 8 * C * I + 2 * C * F + 3 * C
    want = V * C + L * (per_enc + per_dec) + 2 * (8 * 4 + C)
    assert weight_table(cfg).parameter_count() == want


def test_buffer_sets_allocate_exactly_what_they_count():
    from minfer.arena import Arena, align_up
    from minfer.models.t5.buffers import DecodeBuffers, DecoderScratch, EncoderScratch, run_bytes
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


@pytest.mark.parametrize("change,key", [
    ({"feed_forward_proj": "a-" * 2500}, "'feed_forward_proj'"),
    ({"feed_forward_proj": "gated-" + "g" * 5000}, "'feed_forward_proj'"),
    ({"dense_act_fn": "m" * 5000}, "'dense_act_fn'"),
    ({"model_type": "t" * 5000}, "model_type"),
], ids=["proj", "gated-proj", "dense_act_fn", "model_type"])
def test_long_values_from_the_config_are_cut_and_their_key_named(change, key):
    # each was repr'd whole: a 5,092-character message for feed_forward_proj "a-" * 2500
    with pytest.raises(ConfigError) as e:
        t5.T5Config.from_hf({**BASE, **change}, "/m/config.json")
    msg = str(e.value)
    assert msg.startswith(f"/m/config.json: {key}") and "\n" not in msg and len(msg) < 300


@pytest.mark.parametrize("change,said", [
    ({"dense_act_fn": "mish"}, "'dense_act_fn': activation 'mish'"),
    ({"feed_forward_proj": "gated-mish"}, "'feed_forward_proj' 'gated-mish': activation 'mish'"),
    ({"feed_forward_proj": "mish"}, "'feed_forward_proj' 'mish': activation 'mish'"),
])
def test_an_unsupported_activation_names_the_file_and_the_key_that_set_it(change, said):
    # ops.activation's message named only the activation, not where it came from
    with pytest.raises(ConfigError) as e:
        t5.T5Config.from_hf({**BASE, **change}, "/m/config.json")
    assert str(e.value).startswith(f"/m/config.json: {said} is not supported (supported: gelu")


def test_a_long_parts_argument_is_cut_in_the_message():
    cfg = t5.T5Config.from_hf(BASE)
    with pytest.raises(ConfigError) as e:
        cfg.with_parts(["decoder.x"], "p" * 5000, "/m")
    assert str(e.value).startswith("parts='ppp") and len(str(e.value)) < 200
