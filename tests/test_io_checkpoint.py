"""A model folder (io/checkpoint.py): shards and their index, missing pieces, weights only, int8 files."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from factories import folder_with
from minfer.errors import CheckpointError
from minfer.io.checkpoint import Checkpoint






def test_sharded_index(tmp_path):
    folder_with(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, str(tmp_path / "s2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names()) == ["a", "b"]
    np.testing.assert_array_equal(ckpt.read("b"), np.ones(3))


@pytest.mark.parametrize("weight_map,needle", [
    ({"a": "../escape.safetensors"}, "not a file name inside"),
    ({"a": "missing.safetensors"}, "missing.safetensors is missing"),
    ({"a": "s1.safetensors", "zzz": "s1.safetensors"}, "'zzz' is not in its shard"),
    ({}, "weight_map"),
])
def test_bad_index_is_named(tmp_path, weight_map, needle):
    folder_with(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=needle):
        Checkpoint(tmp_path)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: file is missing"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")   # read by legacy.py when no safetensors
    with pytest.raises(CheckpointError, match="pytorch_model.bin: empty file"):
        Checkpoint(tmp_path)


def test_integer_tensor_is_not_a_weight(tmp_path):
    folder_with(tmp_path, {"i": np.arange(3, dtype=np.int64)})
    with pytest.raises(CheckpointError, match="integer dtype I64"):
        Checkpoint(tmp_path).read("i")


def test_checkpoint_prefers_safetensors(tmp_path):
    from safetensors.numpy import save_file
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"never read")
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    assert Checkpoint(tmp_path).names() == ["w"]


def test_other_legacy_names_still_get_the_hint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="found model.pt: only safetensors and "
                                              "pytorch_model.bin are read"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("shards", [3, 20])   # a small index stats each shard, a large one lists
def test_a_shard_that_is_a_fifo_is_named_never_opened(tmp_path, shards):
    import os
    import threading
    folder_with(tmp_path)
    weight_map = {}
    for i in range(shards):
        name = f"s{i}.safetensors"
        weight_map[f"t{i}"] = name
        if i == 1:
            os.mkfifo(tmp_path / name)   # opening it would wait for a writer forever
        else:
            save_file({f"t{i}": np.zeros(2, np.float32)}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    box = {}

    def load():
        try:
            Checkpoint(tmp_path)
        except CheckpointError as e:
            box["error"] = str(e)
    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "load hung on the FIFO"
    assert "s1.safetensors" in box["error"] and ("FIFO" in box["error"] or "missing" in box["error"])


def _make_unreadable(path, kind):
    """Put at `path` something that is there but is no readable file."""
    import os
    if kind == "loop":
        os.symlink(path.name, path)             # a link to itself
    elif kind == "dangling":
        os.symlink(path.name + ".gone", path)   # a link to nothing
    else:
        path.mkdir()


KIND_SAID = {"loop": "a link that loops back on itself", "dangling": "a link to nothing",
             "folder": "a folder"}


@pytest.mark.parametrize("kind", list(KIND_SAID))
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json",
                                  "model.safetensors", "pytorch_model.bin"])
def test_a_weights_or_config_file_that_is_no_readable_file_is_named(tmp_path, name, kind):
    # each was taken for absent: a looping config.json said "file is missing", a looping
    # pytorch_model.bin "found pytorch_model.bin: only safetensors and pytorch_model.bin are
    # read", a looping index or model.safetensors "no model.safetensors or ...index.json"
    if name != "config.json":
        folder_with(tmp_path)
    _make_unreadable(tmp_path / name, kind)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    assert str(e.value) == f"{tmp_path / name}: not a readable file ({KIND_SAID[kind]})"


@pytest.mark.parametrize("kind", list(KIND_SAID))
@pytest.mark.parametrize("shards", [3, 20])   # a small index stats each shard, a large one lists
def test_a_shard_that_is_no_readable_file_is_named(tmp_path, shards, kind):
    # a small index said "shard file s1.safetensors is missing"; a large one gave the OS's
    # "Too many levels of symbolic links" / "No such file or directory"
    folder_with(tmp_path)
    weight_map = {}
    for i in range(shards):
        weight_map[f"t{i}"] = name = f"s{i}.safetensors"
        if i == 1:
            _make_unreadable(tmp_path / name, kind)
        else:
            save_file({f"t{i}": np.zeros(2, np.float32)}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    assert str(e.value) == f"{tmp_path / 's1.safetensors'}: not a readable file ({KIND_SAID[kind]})"


@pytest.mark.parametrize("kind", list(KIND_SAID))
def test_an_optional_json_file_that_is_no_readable_file_is_named_not_skipped(tmp_path, kind):
    # generation_config.json (read by minfer.load) is optional: a looping one was skipped silently
    from minfer.io.checkpoint import read_json
    assert read_json(tmp_path / "generation_config.json") is None      # absent: fine
    _make_unreadable(tmp_path / "generation_config.json", kind)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not a readable file"):
        read_json(tmp_path / "generation_config.json")


def test_other_legacy_names_that_loop_still_get_the_hint(tmp_path):
    # only the files the loader would read are examined: another .bin is still only a hint
    (tmp_path / "config.json").write_text("{}")
    _make_unreadable(tmp_path / "model.bin", "loop")
    with pytest.raises(CheckpointError, match="found model.bin: only safetensors"):
        Checkpoint(tmp_path)
