"""The weight planner (params/planner.py): what stays resident under a limit, and refusals."""
import pytest

from minfer.errors import ConfigError
from minfer.params.planner import plan_weights


def test_planner_keeps_everything_when_it_fits_and_streams_otherwise():
    units = {"encoder.0": 100, "encoder.1": 100, "decoder.0": 120, "decoder.1": 120}
    all_in = plan_weights(units, fixed=50, workspace=30, limit=None)
    assert all_in.resident == list(units) and not all_in.streamed
    assert plan_weights(units, 50, 30, limit=520).streamed == []
    # floor = 50 + 2*120 + 30 = 320; 100 bytes of room: one encoder layer fits, decoders first
    tight = plan_weights(units, 50, 30, limit=420,
                         priority=lambda n: 1 if n.startswith("decoder") else 0)
    assert tight.resident == ["encoder.0"]
    assert tight.streamed == ["encoder.1", "decoder.0", "decoder.1"]
    assert tight.device_bytes <= 420
    roomy = plan_weights(units, 50, 30, limit=450,
                         priority=lambda n: 1 if n.startswith("decoder") else 0)
    assert roomy.resident == ["decoder.0"]  # 130 of room: the decoder layer wins
    assert plan_weights(units, 50, 30, limit=320).resident == []


def test_planner_refuses_with_the_minimum_that_works():
    units = {"a": 100, "b": 100, "c": 100, "d": 100}
    with pytest.raises(ConfigError, match=r"at least 372 bytes") as e:  # 40 + 2*100 + 32 + 100
        plan_weights(units, fixed=40, workspace=32, scratch=100, limit=371)
    assert "streaming slots" in str(e.value)
    assert plan_weights(units, 40, 32, 372, scratch=100).streamed == ["a", "b", "c", "d"]
    # two layers of unequal size: two slots of the larger cost more than keeping both
    with pytest.raises(ConfigError, match=r"440 B of weights.*at least 472 bytes"):
        plan_weights({"a": 100, "b": 300}, fixed=40, workspace=32, limit=471)
    assert plan_weights({"a": 100, "b": 300}, 40, 32, limit=472).streamed == []
