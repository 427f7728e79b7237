"""The weight-table vocabulary (params/table.py): shapes derived from the checkpoint's."""
import numpy as np

from minfer.params.table import Derived, Linear, Tensor, View, WeightTable

TABLE = WeightTable(
    tensors={"q": (6, 4), "k": (6, 4), "v": (2, 4), "n": (4,), "emb": (10, 4), "extra": (3, 4),
             "proj": (4, 9), "buf": (5,)},
    fixed={"head": Linear(("emb",)), "emb": View("head"),
           "part": Tensor("emb", rows=(2, 7), append=("extra",)),
           "slice": Linear(("emb", "extra"), rows=(2, 7)),
           "proj": Linear(("proj",), transpose=True),
           "table": Derived((7, 3), lambda read: np.zeros((7, 3)))},
    stacks={"layers": [{"w": Linear(("q", "k", "v")), "b": Tensor("n")}]},
    buffers=("buf",))


def test_shapes_follow_fusion_transposition_rows_and_views():
    assert TABLE.shape(TABLE.stacks["layers"][0]["w"]) == (14, 4)   # (sum of outs, in)
    assert TABLE.shape(TABLE.fixed["head"]) == (10, 4)
    assert TABLE.shape(TABLE.fixed["emb"]) == (10, 4)
    assert TABLE.shape(TABLE.fixed["part"]) == (8, 4)                # 5 rows + 3 appended
    assert TABLE.shape(TABLE.fixed["slice"]) == (8, 4)
    assert TABLE.shape(TABLE.fixed["proj"]) == (9, 4)                # stored (in, out)
    assert TABLE.shape(TABLE.fixed["table"]) == (7, 3)


def test_units_linear_sources_and_parameter_count():
    assert [name for name, _ in TABLE.units()] == ["layers.0"]
    # every slot's sources but the one stored (in, out), whose rows are not output channels
    assert TABLE.linear_sources() == {"q", "k", "v", "emb", "extra"}
    assert TABLE.parameter_count() == 24 + 24 + 8 + 4 + 40 + 12 + 36  # the buffer not counted
