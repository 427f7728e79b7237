"""The shared façade (models/base.py): input batches, sizes, the decoding protocol."""
import pytest
from factories import write_t5

import minfer
from minfer.errors import ArenaExhausted, InputError


@pytest.mark.parametrize("inputs,needle", [([], "empty"), ([[3, 4], []], "row 1 is empty"),
                                           ([[3, 999]], "token id 999"), ([[3, -1]], "token id -1"),
                                           ([["a"]], "row 0 holds")])
def test_bad_inputs_are_named(tmp_path, inputs, needle):
    model = minfer.load(write_t5(tmp_path / "m"))
    with pytest.raises(InputError, match=needle):
        model.generate(inputs, max_new_tokens=3)


def test_too_small_workspace_fails_up_front(tmp_path):
    model = minfer.load(write_t5(tmp_path / "m"), workspace="64KiB")
    with pytest.raises(ArenaExhausted, match="bytes available of 65536"):
        model.generate([[3, 4, 5, 1]], max_new_tokens=100_000)
    assert model.backend.arena.used == 0
