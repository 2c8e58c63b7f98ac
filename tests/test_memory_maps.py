"""Compiled executables against Linux's per-process limit on memory maps (jspec.memory_maps)."""

import collections
import os

import jax
import jax.numpy as jnp
import pytest

from jspec import memory_maps, runner
from conftest import make_engine

LIMIT = 65530
RELIEVE, REFUSE = memory_maps.thresholds(LIMIT)


def fake_maps(monkeypatch, counts, limit=LIMIT):
    """map_limit() -> limit; map_count() -> the next of ``counts`` (the last repeats); no
    release remembered."""
    seen = list(counts)
    monkeypatch.setattr(memory_maps, "_after_release", [0])
    monkeypatch.setattr(memory_maps, "map_limit", lambda: limit)
    monkeypatch.setattr(memory_maps, "map_count",
                        lambda: seen.pop(0) if len(seen) > 1 else seen[0])


@pytest.mark.skipif(not os.path.exists(memory_maps.MAPS_FILE), reason="no /proc on this OS")
def test_a_compiled_executable_holds_memory_maps():
    assert memory_maps.map_limit() > 1000
    before = memory_maps.map_count()
    exe = runner.compile_lowered(jax.jit(lambda x: jnp.tanh(x) * 3 + 1).lower(
        jax.ShapeDtypeStruct((7, 13), jnp.float32)))
    assert memory_maps.map_count() > before
    del exe


def test_thresholds_leave_room_for_a_compilation():
    assert RELIEVE < REFUSE < LIMIT
    assert LIMIT - REFUSE >= 2048
    small_relieve, small_refuse = memory_maps.thresholds(8192)
    assert 0 < small_relieve < small_refuse < 8192


def test_below_the_limit_nothing_is_released(monkeypatch):
    fake_maps(monkeypatch, [RELIEVE - 1])
    memory_maps.make_room(lambda: pytest.fail("released below the threshold"))


def test_without_a_limit_to_read_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(memory_maps, "map_limit", lambda: None)
    monkeypatch.setattr(memory_maps, "map_count", lambda: pytest.fail("counted without a limit"))
    memory_maps.make_room(lambda: pytest.fail("released without a limit"))


def test_near_the_limit_unused_executables_are_released(monkeypatch, capsys):
    released = []
    fake_maps(monkeypatch, [RELIEVE + 10, RELIEVE - 5000])
    memory_maps.make_room(lambda: released.append(1) or 7)
    assert released == [1]
    err = capsys.readouterr().err
    assert f"{RELIEVE + 10} memory maps of the {LIMIT}" in err
    assert "released 7 cached executables" in err


def test_engines_that_stay_alive_are_not_released_at_every_compilation(monkeypatch):
    """After a release that left the live engines' mappings near the limit, the next release
    waits until they grow by a share of it (a release per compilation would free nothing);
    at the refusing threshold it releases again before refusing."""
    released = []
    step = LIMIT // 32
    fake_maps(monkeypatch, [RELIEVE + 10, RELIEVE + 5, RELIEVE + 5 + step - 1,
                            RELIEVE + 5 + step, RELIEVE + 5 + step, REFUSE, REFUSE])
    memory_maps.make_room(lambda: released.append(1) or 0)
    assert len(released) == 1
    memory_maps.make_room(lambda: released.append(2) or 0)
    assert len(released) == 1
    memory_maps.make_room(lambda: released.append(3) or 0)
    assert released == [1, 3]
    with pytest.raises(memory_maps.MemoryMapLimitError):
        memory_maps.make_room(lambda: released.append(4) or 0)
    assert released == [1, 3, 4]


def test_when_live_engines_hold_too_many_the_error_says_so(monkeypatch):
    fake_maps(monkeypatch, [REFUSE + 100, REFUSE + 50])
    with pytest.raises(memory_maps.MemoryMapLimitError) as e:
        memory_maps.make_room(lambda: 0)
    msg = str(e.value)
    assert f"holds {REFUSE + 50} memory maps" in msg and f"limit of {LIMIT}" in msg
    assert "vm.max_map_count" in msg and "del llm" in msg


def test_an_engine_compiles_nothing_past_the_limit(monkeypatch, engine_models):
    """An engine built near the limit empties the process cache of executables and refuses to
    compile with the error above, instead of letting XLA crash the process."""
    target, _, _ = engine_models
    cached = collections.OrderedDict({("held by nobody",): object()})
    monkeypatch.setattr(runner, "_EXECUTABLES", cached)
    built = []
    monkeypatch.setattr(runner, "compile_lowered", lambda lowered: built.append(lowered))
    fake_maps(monkeypatch, [REFUSE + 1])
    with pytest.raises(memory_maps.MemoryMapLimitError, match="vm.max_map_count"):
        make_engine(target, None, policy="off")  # warms up: compiles every bucket
    assert not cached and not built
