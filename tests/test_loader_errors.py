"""Errors for files and arguments minfer did not write: every message one bounded line."""
from __future__ import annotations

import pytest

from minfer import hub
from minfer.errors import ConfigError, MinferError
from minfer.io.sentence_transformers import shown
from minfer.models.transfo_xl.config import XLConfig

LONG = 5000   # characters of a value: its message must stay a few hundred at most


def one_short_line(error: BaseException, limit: int = 300) -> str:
    msg = str(error)
    assert "\n" not in msg and len(msg) < limit, (len(msg), msg[:400])
    return msg


@pytest.mark.parametrize("value,said", [
    ("abc", "'abc'"), ("a\nb\x00", r"'a\nb\x00'"), ("x" * LONG, "'" + "x" * 60 + "...'"),
    ([1] * 30000, "a JSON list of 30000 items"), ({"a": 1}, "a JSON object of 1 item"),
    (10**400, "a 1329-bit integer"), (b"x" * LONG, f"a bytes of length {LONG}"),
    ((1, 2), "(1, 2)"), (None, "None"), (1.5, "1.5")])
def test_shown_quotes_any_value_in_a_bounded_line(value, said):
    assert shown(value) == said


def test_transfo_xl_model_type_is_cut():
    with pytest.raises(ConfigError) as e:
        XLConfig.from_hf({"model_type": "t" * LONG}, "/m/config.json")
    assert one_short_line(e.value).startswith("/m/config.json: model_type 'ttt")


@pytest.mark.parametrize("kw", [
    dict(revision="r" * LONG), dict(revision=["main"] * 30000), dict(subfolder="s/" * LONG),
    dict(subfolder=["x"] * 30000)], ids=["revision", "revision-list", "subfolder", "subfolder-list"])
def test_hub_arguments_are_cut_in_messages(tmp_path, kw):
    # each was repr'd or quoted whole (a 5,000-character revision gave a 5,200-character line)
    with pytest.raises(MinferError) as e:
        hub.resolve_model("t5-small", offline=True, cache_dir=tmp_path, **kw)
    one_short_line(e.value, 300 + len(str(tmp_path)))   # the message names the cache


@pytest.mark.parametrize("sub", ["s" * LONG, "s/" * LONG], ids=["over-name-limit", "many-parts"])
def test_a_long_local_subfolder_is_cut(tmp_path, sub):
    # a component over the file-name limit raised a raw OSError from is_dir
    with pytest.raises(MinferError) as e:
        hub.resolve_model(tmp_path, subfolder=sub)
    assert "subfolder 's" in one_short_line(e.value, 300 + len(str(tmp_path)))


@pytest.mark.parametrize("name", ["./" + "a/" * 2000, b"x" * LONG, ("x",) * 30000])
def test_hub_names_are_cut_in_messages(name):
    # a 4,000-character path under PATH_MAX said "no such folder '<all of it>'"
    with pytest.raises(MinferError) as e:
        hub.resolve_model(name, offline=True)
    one_short_line(e.value)


@pytest.mark.parametrize("kw", [dict(name_or_path="t5-small", revision="v1\nInjected: line"),
                                dict(name_or_path="./no\nsuch\x00folder")], ids=["revision", "path"])
def test_hub_messages_escape_control_characters(tmp_path, kw):
    # a newline in a revision or a path split the one-line message in two
    with pytest.raises(MinferError) as e:
        hub.resolve_model(offline=True, cache_dir=tmp_path, **kw)
    assert "\\n" in one_short_line(e.value, 300 + len(str(tmp_path)))


def test_a_long_cache_dir_is_cut(tmp_path):
    # the message quoted cache_dir whole
    cache = tmp_path / ("c" * 200) / ("d" * 200) / ("e" * 200)
    with pytest.raises(MinferError) as e:
        hub.resolve_model("t5-small", offline=True, cache_dir=cache)
    assert "characters)" in one_short_line(e.value, 400)
