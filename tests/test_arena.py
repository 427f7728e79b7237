"""The explicit allocator (arena.py): aligned typed blocks, scopes, holds, budgets, typed buffer sets."""
import numpy as np
import pytest

from minfer.arena import ALIGNMENT, Arena, align_up, bytes_needed, parse_bytes
from minfer.errors import ArenaExhausted, ConfigError


def address(a):
    return a.__array_interface__["data"][0]


def test_blocks_are_aligned_and_typed():
    arena = Arena(64 * 1024)
    for shape, dtype in [((3,), np.float32), ((5, 7), np.float64), ((1,), np.int8), ((2, 3, 4), np.int64)]:
        a = arena.alloc(shape, dtype)
        assert a.shape == shape and a.dtype == dtype
        assert address(a) % ALIGNMENT == 0
        assert a.flags.c_contiguous and a.flags.writeable


def test_live_blocks_do_not_overlap():
    arena = Arena(1 << 20)
    rng = np.random.default_rng(0)
    blocks = [arena.alloc((int(rng.integers(1, 500)),), np.float32) for _ in range(50)]
    spans = sorted((address(b), address(b) + b.nbytes) for b in blocks)
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert e0 <= s1
    for i, b in enumerate(blocks):  # writing one block leaves the others intact
        b[...] = i
    assert all((b == i).all() for i, b in enumerate(blocks))


def test_stats_track_current_and_peak():
    arena = Arena(10_000)
    assert arena.stats().used == 0
    with arena.scope():
        arena.alloc((1000,), np.float32)  # 4000 bytes
        with arena.scope():
            arena.alloc((100,), np.float32)  # aligned start at 4096
            assert arena.stats().used == 4096 + 400
        assert arena.stats().used == 4000
    stats = arena.stats()
    assert (stats.used, stats.peak, stats.capacity) == (0, 4496, 10_000)


def test_reset_reuses_the_same_memory():
    arena = Arena(4096)
    a = arena.alloc((256,), np.float32)
    arena.reset()
    b = arena.alloc((256,), np.float32)
    assert address(a) == address(b)
    mark = arena.mark()
    c = arena.alloc((10,), np.float32)
    arena.release(mark)
    d = arena.alloc((10,), np.float32)
    assert address(c) == address(d)


def test_exhaustion_names_requested_and_available_bytes():
    arena = Arena(1024, name="test")
    arena.alloc((100,), np.uint8)
    with pytest.raises(ArenaExhausted) as err:
        arena.alloc((1000,), np.uint8, "kv cache")
    assert isinstance(err.value, MemoryError)
    msg = str(err.value)
    assert "1000 bytes" in msg and "768 bytes available" in msg and "kv cache" in msg
    assert arena.used == 100  # a failed request changes nothing


def test_alloc_many_is_all_or_nothing():
    arena = Arena(2048)
    specs = {"a": ((256,), np.float32), "b": ((256,), np.float32)}  # 2048 bytes exactly
    assert bytes_needed(specs) == 2048
    bufs = arena.alloc_many(specs)
    assert set(bufs) == {"a", "b"}
    arena.reset()
    arena.alloc((1,), np.uint8)
    with pytest.raises(ArenaExhausted):
        arena.alloc_many(specs)
    assert arena.used == 1


def test_release_outside_the_stack_is_refused():
    arena = Arena(1024)
    arena.alloc((10,), np.uint8)
    with pytest.raises(ValueError):
        arena.release(500)


@pytest.mark.parametrize("text,expected", [("2GiB", 2 * 1024**3), ("512MB", 512 * 10**6),
                                           ("1.5k", 1500), (4096, 4096), ("100", 100)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "2 parsecs", True, -5])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises(ConfigError):
        parse_bytes(bad, "workspace")


def test_align_up():
    assert [align_up(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]


def test_holds_outlive_scopes_and_release_in_any_order():
    arena = Arena(1 << 16)
    a = arena.hold({"m": ((100,), np.float32)})
    with arena.scope():
        arena.alloc((10,), np.float32)
    b = arena.hold({"m": ((50,), np.float32)})
    a.buffers["m"][...] = 1
    assert arena.used == b.end
    a.release()                      # not on top: its span becomes a gap that holds reuse
    assert arena.used == b.end - a.nbytes
    c = arena.hold({"m": ((60,), np.float32)})
    assert c.start == a.start and c.end <= b.start   # fits in a's old span
    b.release()
    c.release()
    assert arena.used == 0 and arena.mark() == 0     # everything back, the top down to 0
    c.release()                      # idempotent
    assert arena.used == 0


def test_holds_released_in_random_order_never_overlap_and_all_come_back():
    rng = np.random.default_rng(0)
    arena = Arena(1 << 20)
    live = []
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 12):
            live.pop(int(rng.integers(len(live)))).release()
        else:
            h = arena.hold({"x": ((int(rng.integers(1, 2000)),), np.float32)})
            h.buffers["x"][...] = step
            live.append(h)
        spans = sorted((h.start, h.end) for h in live)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))  # no overlap
        assert arena.used == sum(h.end - h.start for h in live)   # used counts live bytes
        for h in live:                                                     # nobody was clobbered
            assert (h.buffers["x"] == h.buffers["x"][0]).all()
    for h in live:
        h.release()
    assert arena.used == 0 and arena.mark() == 0


def test_a_hold_released_while_a_scope_is_open_waits_for_it():
    arena = Arena(1 << 16)
    h = arena.hold({"m": ((100,), np.float32)})
    with arena.scope():
        x = arena.alloc((10,), np.float32)
        h.release()                  # the scope's block sits above: the top must stay
        assert arena.mark() > h.end and x.size == 10
    assert arena.used == 0 and arena.mark() == 0


@pytest.mark.parametrize("seed", range(6))
def test_exhaustion_names_whole_buffers_without_stray_separators(seed):
    """Names of every length, cut anywhere: the message lists whole names and 'and N more'."""
    rng = np.random.default_rng(seed)
    names = [f"buf_{'x' * int(rng.integers(0, 60))}_{i}" for i in range(int(rng.integers(1, 30)))]
    specs = {name: ((64,), np.float32) for name in names}
    with pytest.raises(ArenaExhausted) as err:
        Arena(256, name="t").alloc_many(specs)
    msg = str(err.value)
    assert ", :" not in msg and ",:" not in msg and "\n" not in msg
    label = msg.split(" for ", 1)[1].split(": ", 1)[0]
    shown = label.split(" and ")[0].split(", ")
    assert all(name in names for name in shown), (shown, names)
    more = len(names) - len(shown)
    assert (f" and {more} more" in label) == (more > 0), label
    assert len(label) < 200


def test_describe_names_cuts_one_giant_name():
    from minfer.arena import describe_names
    assert describe_names(["a", "b"]) == "a, b"
    assert describe_names(["q" * 500]) == "q" * 100 + "..."
    assert describe_names(["q" * 500, "r"]) == "q" * 100 + "... and 1 more"


def test_an_arena_the_machine_cannot_back_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        Arena(1 << 62, name="cpu")      # NumPy's MemoryError, multi-line, becomes one line
    msg = str(err.value)
    assert "arena 'cpu'" in msg and str(1 << 62) in msg and "\n" not in msg
