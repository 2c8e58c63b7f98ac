"""BlockManager: allocation, rollback, page-table rows, invariants (prefix caching and shared
blocks: tests/test_prefix_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jspec.block_manager import NULL_BLOCK, BlockManager


def test_construction_validates():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0)


def test_initial_counts_reserve_null_block():
    bm = BlockManager(8, 4)
    assert bm.num_usable_blocks == 7
    assert bm.num_free_blocks == 7
    assert bm.num_used_blocks == 0
    bm.check_invariants()


@pytest.mark.parametrize("slots,blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_is_ceil_division(slots, blocks):
    assert BlockManager(8, 4).blocks_needed(slots) == blocks


def test_allocate_covers_slots_and_never_hands_out_null_block():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", 5)
    table = bm.block_table("a")
    assert len(table) == 2 and NULL_BLOCK not in table
    assert bm.num_slots("a") == 8
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 5
    # lowest free ids first
    assert table == [1, 2]
    bm.check_invariants()


def test_allocate_grows_incrementally_and_is_noop_when_covered():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", 3)
    assert bm.allocate("a", 4)  # still one block
    assert bm.block_table("a") == [1]
    assert bm.allocate("a", 9)
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.allocate("a", 2)  # smaller than capacity: no-op, never shrinks
    assert bm.block_table("a") == [1, 2, 3]
    bm.check_invariants()


def test_allocate_zero_slots_registers_an_empty_table():
    bm = BlockManager(4, 4)
    assert not bm.has("a")
    assert bm.allocate("a", 0)
    assert bm.has("a") and bm.block_table("a") == [] and bm.num_slots("a") == 0
    bm.free("a")
    assert not bm.has("a")


def test_allocate_is_all_or_nothing():
    bm = BlockManager(5, 4)  # 4 usable blocks
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 12)
    assert not bm.has("b")  # failed first allocation creates nothing
    assert bm.num_free_blocks == 2
    assert bm.allocate("b", 8)
    assert not bm.allocate("b", 9)  # existing table: unchanged on failure
    assert bm.block_table("b") == [3, 4]
    bm.check_invariants()


def test_allocate_more_than_the_pool_could_ever_hold_is_false():
    bm = BlockManager(5, 4)
    assert not bm.allocate("a", 17)
    assert bm.allocate("a", 16)
    assert bm.num_free_blocks == 0


def test_negative_slots_rejected():
    bm = BlockManager(4, 4)
    bm.allocate("a", 1)
    with pytest.raises(ValueError):
        bm.allocate("a", -1)
    with pytest.raises(ValueError):
        bm.truncate("a", -1)


def test_truncate_frees_whole_trailing_blocks_only():
    bm = BlockManager(8, 4)
    bm.allocate("a", 16)
    assert bm.block_table("a") == [1, 2, 3, 4]
    bm.truncate("a", 9)  # 9 slots need 3 blocks
    assert bm.block_table("a") == [1, 2, 3]
    bm.truncate("a", 8)
    assert bm.block_table("a") == [1, 2]
    bm.truncate("a", 100)  # never grows
    assert bm.block_table("a") == [1, 2]
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.has("a")
    assert bm.num_free_blocks == 7
    bm.check_invariants()


def test_freed_blocks_are_reused_lowest_first():
    bm = BlockManager(8, 1)
    bm.allocate("a", 3)  # 1 2 3
    bm.allocate("b", 2)  # 4 5
    bm.free("a")
    bm.allocate("c", 2)
    assert bm.block_table("c") == [1, 2]
    bm.check_invariants()


def test_free_returns_blocks_and_forgets_the_table():
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)
    bm.free("a")
    assert not bm.has("a")
    assert bm.num_free_blocks == 7
    bm.check_invariants()


@pytest.mark.parametrize("call", [
    lambda bm: bm.free("ghost"),
    lambda bm: bm.truncate("ghost", 0),
    lambda bm: bm.block_table("ghost"),
    lambda bm: bm.num_slots("ghost"),
    lambda bm: bm.fill_page_table(np.zeros((1, 4), np.int32), 0, "ghost"),
])
def test_unknown_request_id_raises_key_error_naming_it(call):
    bm = BlockManager(8, 4)
    with pytest.raises(KeyError, match="ghost"):
        call(bm)


def test_double_free_raises_key_error():
    bm = BlockManager(8, 4)
    bm.allocate("a", 1)
    bm.free("a")
    with pytest.raises(KeyError, match="'a'"):
        bm.free("a")


def test_block_table_is_a_copy():
    bm = BlockManager(8, 4)
    bm.allocate("a", 4)
    bm.block_table("a").append(7)
    assert bm.block_table("a") == [1]


def test_fill_page_table_writes_row_and_leaves_rest():
    bm = BlockManager(8, 4)
    bm.allocate("a", 5)
    bm.allocate("b", 9)
    out = np.zeros((3, 6), np.int32)
    bm.fill_page_table(out, 0, "b")
    bm.fill_page_table(out, 2, "a")
    np.testing.assert_array_equal(out, [[3, 4, 5, 0, 0, 0], [0] * 6, [1, 2, 0, 0, 0, 0]])


def test_fill_page_table_follows_table_changes():
    bm = BlockManager(8, 4)
    bm.allocate("a", 4)
    out = np.zeros((1, 6), np.int32)
    bm.fill_page_table(out, 0, "a")
    assert out[0].tolist() == [1, 0, 0, 0, 0, 0]
    bm.allocate("a", 12)
    out[:] = 0
    bm.fill_page_table(out, 0, "a")
    assert out[0].tolist() == [1, 2, 3, 0, 0, 0]
    bm.truncate("a", 5)
    out[:] = 0
    bm.fill_page_table(out, 0, "a")
    assert out[0].tolist() == [1, 2, 0, 0, 0, 0]
    bm.free("a")
    bm.allocate("a", 4)  # same id, new table
    out[:] = 0
    bm.fill_page_table(out, 0, "a")
    assert out[0].tolist() == [1, 0, 0, 0, 0, 0]
    bm.check_invariants()


def test_fill_page_table_too_narrow_is_an_error():
    bm = BlockManager(8, 4)
    bm.allocate("a", 12)
    with pytest.raises(ValueError, match="3 blocks"):
        bm.fill_page_table(np.zeros((1, 2), np.int32), 0, "a")


def _corrupt(kind: str) -> BlockManager:
    bm = BlockManager(8, 4)
    bm.allocate("a", 8)
    bm.allocate("b", 4)
    if kind == "duplicate":
        bm._free.append(bm._free[-1])
    elif kind == "null-free":
        bm._free.insert(0, 0)
    elif kind == "refcount":
        bm._refcounts[1] = 2
    elif kind == "free-and-held":
        bm._free.insert(0, 1)
        bm._refcounts[1] = 1
    elif kind == "leak":
        bm._free.pop()
    elif kind == "null-owned":
        bm._tables["b"].append(0)
    elif kind == "stale-cache":
        bm.fill_page_table(np.zeros((1, 4), np.int32), 0, "a")
        bm._table_arrays["a"][0] = 7
    return bm


@pytest.mark.parametrize("kind,message", [
    ("duplicate", "duplicate"),
    ("null-free", "null block"),
    ("refcount", "refcount"),
    ("free-and-held", "free"),
    ("leak", "leaked"),
    ("null-owned", "invalid block 0"),
    ("stale-cache", "stale"),
])
def test_check_invariants_detects_corruption(kind, message):
    with pytest.raises(AssertionError, match=message):
        _corrupt(kind).check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations against a simple model: per-request list of blocks."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=13, block_size=3)
        self.model: dict[str, int] = {}  # request id -> expected number of blocks
        self.counter = 0

    def _ids(self):
        return sorted(self.model)

    @rule(slots=st.integers(0, 40))
    def allocate_new(self, slots):
        rid = f"r{self.counter}"
        self.counter += 1
        need = self.bm.blocks_needed(slots)
        ok = self.bm.allocate(rid, slots)
        assert ok == (need <= self.bm.num_usable_blocks - self._used())
        if ok:
            self.model[rid] = need

    @precondition(lambda self: self.model)
    @rule(data=st.data(), slots=st.integers(0, 40))
    def grow(self, data, slots):
        rid = data.draw(st.sampled_from(self._ids()))
        ok = self.bm.allocate(rid, slots)
        if ok:
            self.model[rid] = max(self.model[rid], self.bm.blocks_needed(slots))
        assert len(self.bm.block_table(rid)) == self.model[rid]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), slots=st.integers(0, 40))
    def truncate(self, data, slots):
        rid = data.draw(st.sampled_from(self._ids()))
        self.bm.truncate(rid, slots)
        self.model[rid] = min(self.model[rid], self.bm.blocks_needed(slots))
        assert len(self.bm.block_table(rid)) == self.model[rid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(self._ids()))
        self.bm.free(rid)
        del self.model[rid]

    def _used(self) -> int:
        held = set()
        for rid in self.model:
            held.update(self.bm.block_table(rid))
        return len(held)

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == self._used()
        out = np.zeros((max(1, len(self.model)), 13), np.int32)
        for row, rid in enumerate(self._ids()):
            self.bm.fill_page_table(out, row, rid)
            assert out[row, :self.model[rid]].tolist() == self.bm.block_table(rid)


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=60, stateful_step_count=40,
                                             deadline=None)
