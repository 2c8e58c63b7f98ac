"""Paged-KV block allocation on the host: free list, reference counts, one block table per sequence.

Every model's KV pool (target and drafts) has the same ``block_size`` and the same base
``num_blocks``, so a physical block id means the same slot range in every pool and one manager
(one page table per sequence) serves all models. Only the target's pool also holds the elastic
extension's blocks, which sequences hold only while the draft is offloaded (below).

Physical block 0 is the reserved *null block*: padding tokens write their K/V there and unused
page-table entries point at it, so it is never free and never owned by a sequence. Usable blocks
are ``1 .. num_blocks - 1``.

A sequence's table covers ``len(table) * block_size`` token slots (positions ``0 ..`` that - 1).
Rollback after a rejected draft is :meth:`BlockManager.truncate`: whole trailing blocks go back to
the free list and nothing moves, because the stale K/V left in a kept block sits at positions above
every live query and attention masks it by position.

Elastic pool (Nightjar §5, ``jspec/elastic.py``): the ids ``num_base_blocks .. num_blocks - 1``
are the *extension*: one numbering with the base, though on the device they live in a second
array allocated only while the pool is expanded (``pallas_kernels.segments``). They are reserved,
outside the free list, until :meth:`expand` hands them out; :meth:`contraction_plan` and
:meth:`contract` move every live block out of the extension again and take it back.

Free-list policy: lowest free block id first (a min-heap). Keeping live blocks packed at low ids
means that an expanded pool uses the extension only once the base is full, and contraction has as
few live blocks to migrate out of it as possible. The cost is O(log n) per block handed out or
returned, and blocks change hands only at block boundaries (about once every ``block_size``
tokens per sequence).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import numpy as np

NULL_BLOCK = 0


class BlockManager:
    """Allocates physical KV blocks to sequences (keyed by request id), with reference counts.

    Reference counts exist because :meth:`fork` lets several sequences share blocks; a block
    returns to the free list only when the last table holding it lets it go.
    """

    def __init__(self, num_blocks: int, block_size: int, num_extension_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), "
                             f"got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= num_extension_blocks <= num_blocks - 2:
            raise ValueError(f"num_extension_blocks must be in [0, {num_blocks - 2}] (the base "
                             f"keeps a usable block), got {num_extension_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_base_blocks = num_blocks - num_extension_blocks  # the null block included
        self.expanded = False
        # range(1, n) ascending is already a valid min-heap.
        self._free: list[int] = list(range(1, self.num_base_blocks))
        self._refcounts: list[int] = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        # int32 mirrors of the tables for fill_page_table: copying an array slice into the page
        # table is several times faster than converting a list every step. A mirror may be
        # longer than its table (capacity grows by doubling; truncation leaves a stale tail):
        # only its first len(table) entries are meaningful.
        self._table_arrays: dict[Hashable, np.ndarray] = {}

    # ------------------------------------------------------------------ capacity

    @property
    def num_extension_blocks(self) -> int:
        return self.num_blocks - self.num_base_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that sequences can hold now (all but the null block; the extension's only
        while expanded)."""
        return (self.num_blocks if self.expanded else self.num_base_blocks) - 1

    @property
    def num_base_usable_blocks(self) -> int:
        """Blocks sequences can always hold, expanded or not: what a request must fit in."""
        return self.num_base_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def blocks_needed(self, num_slots: int) -> int:
        """Blocks that cover ``num_slots`` token slots (ceil division)."""
        return -(-num_slots // self.block_size)

    # ------------------------------------------------------------------ per-sequence queries

    def has(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: Hashable) -> list[int]:
        """A copy of the sequence's logical -> physical block list."""
        return list(self._table(request_id))

    def num_slots(self, request_id: Hashable) -> int:
        """Token slots the sequence's table covers (its KV capacity, not its length)."""
        return len(self._table(request_id)) * self.block_size

    def fill_page_table(self, out: np.ndarray, row: int, request_id: Hashable) -> None:
        """Write the sequence's table into ``out[row, :len(table)]`` (an int32 ``[S, P]`` array).

        The rest of the row is left alone: the caller hands in zeros, i.e. the null block.
        """
        table = self._tables.get(request_id)
        if table is None:
            raise KeyError(f"unknown request id {request_id!r}")
        n = len(table)
        if n > out.shape[1]:
            raise ValueError(f"request {request_id!r} holds {n} blocks but the page table has "
                             f"only {out.shape[1]} columns")
        if n:
            out[row, :n] = self._table_arrays[request_id][:n]

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, request_id: Hashable, num_slots: int) -> bool:
        """Whether :meth:`allocate` would succeed (an unknown id counts as an empty table)."""
        table = self._tables.get(request_id)
        held = len(table) if table is not None else 0
        return self.blocks_needed(num_slots) - held <= len(self._free)

    def allocate(self, request_id: Hashable, num_slots: int) -> bool:
        """Grow the sequence's table so it covers ``num_slots`` slots (positions 0..num_slots-1).

        All-or-nothing: returns False and changes nothing when too few blocks are free (also when
        ``num_slots`` exceeds what the whole pool could ever hold). A no-op when already covered.
        The first successful call for a request id creates its table.
        """
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        table = self._tables.get(request_id)
        held = len(table) if table is not None else 0
        missing = -(-num_slots // self.block_size) - held
        if missing <= 0:
            if table is None:
                self._tables[request_id] = []
            return True
        free = self._free
        if missing > len(free):
            return False
        if table is None:
            table = self._tables[request_id] = []
        refcounts = self._refcounts
        for _ in range(missing):
            block = heapq.heappop(free)
            refcounts[block] = 1
            table.append(block)
        self._mirror(request_id, table, held)
        return True

    def truncate(self, request_id: Hashable, num_slots: int) -> None:
        """Roll back: release the trailing blocks not needed to cover ``num_slots`` slots.

        No data moves; K/V left in the kept last block beyond ``num_slots`` is stale and masked.
        Truncating to more than the current capacity is a no-op (it never grows the table).
        """
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        table = self._table(request_id)
        keep = -(-num_slots // self.block_size)
        if keep >= len(table):
            return
        self._release(table[keep:])
        del table[keep:]

    def free(self, request_id: Hashable) -> None:
        """Drop the sequence's table; its blocks are freed unless another table still holds them."""
        table = self._table(request_id)
        self._release(table)
        del self._tables[request_id]
        self._table_arrays.pop(request_id, None)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give ``child_id`` a table sharing all of the parent's blocks (reference counted).

        There is no copy-on-write yet: the caller must not let both write into a shared block.
        """
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        refcounts = self._refcounts
        for block in parent:
            refcounts[block] += 1
        self._tables[child_id] = list(parent)
        self._mirror(child_id, parent, 0)

    # ------------------------------------------------------------------ elastic pool
    def expand(self) -> int:
        """Hand out the extension's blocks (Nightjar §5.2: appended to the free list, nothing
        moves). Returns how many blocks became free."""
        if self.expanded:
            raise RuntimeError("the KV pool is already expanded")
        if not self.num_extension_blocks:
            raise RuntimeError("this block manager has no extension blocks")
        # every extension id is above every base id, so appending them in ascending order keeps
        # the min-heap valid: each new entry's parent is a smaller id already in the heap
        self._free.extend(range(self.num_base_blocks, self.num_blocks))
        self.expanded = True
        return self.num_extension_blocks

    def contraction_plan(self) -> list[tuple[int, int]] | None:
        """Moves (source, destination) that empty the extension: every live block in it goes to
        a free base block, lowest first (§5.3 steps 1-2). ``None`` when the free base blocks
        cannot take them all. Sources are live and destinations free, so the two sets are
        disjoint and the copies commute (``pallas_kernels.kv_migration``)."""
        if not self.expanded:
            raise RuntimeError("the KV pool is not expanded")
        base = self.num_base_blocks
        live = sorted(b for b in range(base, self.num_blocks) if self._refcounts[b])
        free_base = sorted(b for b in self._free if b < base)
        if len(live) > len(free_base):
            return None
        return list(zip(live, free_base))

    def contract(self, moves: list[tuple[int, int]]) -> None:
        """Apply a :meth:`contraction_plan` to the tables (after its K/V were copied) and take the
        extension back (§5.3 steps 3 and 5)."""
        if not self.expanded:
            raise RuntimeError("the KV pool is not expanded")
        base = self.num_base_blocks
        remap = dict(moves)
        live = {b for b in range(base, self.num_blocks) if self._refcounts[b]}
        if set(remap) != live:
            raise ValueError(f"the moves cover extension blocks {sorted(remap)} but the live "
                             f"ones are {sorted(live)}")
        free_set = set(self._free)
        for src, dst in moves:
            if not (dst < base and dst in free_set):
                raise ValueError(f"destination block {dst} is not a free base block")
            free_set.discard(dst)
            self._refcounts[dst], self._refcounts[src] = self._refcounts[src], 0
        for request_id, table in self._tables.items():
            if any(b >= base for b in table):
                table[:] = [remap.get(b, b) for b in table]
                self._mirror(request_id, table, 0)
        self._free = sorted(b for b in free_set if b < base)  # sorted is a valid min-heap
        self.expanded = False

    # ------------------------------------------------------------------ checking

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first inconsistency found (for tests/debugging)."""
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            dups = sorted(b for b in free_set if free.count(b) > 1)
            raise AssertionError(f"duplicate blocks in the free list: {dups}")
        if NULL_BLOCK in free_set:
            raise AssertionError("the null block 0 is in the free list")
        limit = self.num_usable_blocks + 1  # the extension is out of range unless expanded
        out_of_range = sorted(b for b in free_set if not 0 < b < limit)
        if out_of_range:
            raise AssertionError(f"free list holds out-of-range blocks {out_of_range}")
        for i in range(1, len(free)):
            if free[(i - 1) // 2] > free[i]:
                raise AssertionError("the free list is not a valid min-heap")
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id!r} holds a block twice: {table}")
            for block in table:
                if not 0 < block < limit:
                    raise AssertionError(f"request {request_id!r} holds invalid block {block}")
                holders[block] += 1
        for block in range(self.num_blocks):
            if holders[block] != self._refcounts[block]:
                raise AssertionError(f"block {block}: refcount {self._refcounts[block]} but held "
                                     f"by {holders[block]} tables")
            if holders[block] and block in free_set:
                raise AssertionError(f"block {block} is both free and held")
        used = sum(1 for count in holders if count)
        if used + len(free) != self.num_usable_blocks:
            raise AssertionError(f"{used} used + {len(free)} free != "
                                 f"{self.num_usable_blocks} usable blocks (leaked blocks)")
        for request_id, table in self._tables.items():
            arr = self._table_arrays.get(request_id)
            if table and (arr is None or arr[:len(table)].tolist() != table):
                raise AssertionError(f"stale page-table mirror for request {request_id!r}")
        extra = set(self._table_arrays) - set(self._tables)
        if extra:
            raise AssertionError(f"page-table mirrors of freed requests {sorted(map(repr, extra))}")

    # ------------------------------------------------------------------ internals

    def _table(self, request_id: Hashable) -> list[int]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def _mirror(self, request_id: Hashable, table: list[int], start: int) -> None:
        """Copy ``table[start:]`` into the request's int32 mirror, growing it if needed."""
        arr = self._table_arrays.get(request_id)
        n = len(table)
        if arr is None or arr.shape[0] < n:
            grown = np.zeros(max(8, 2 * n), dtype=np.int32)
            if arr is not None:
                grown[:start] = arr[:start]
            arr = self._table_arrays[request_id] = grown
        arr[start:n] = table[start:]

    def _release(self, blocks: list[int]) -> None:
        refcounts = self._refcounts
        free = self._free
        for block in blocks:
            count = refcounts[block] - 1
            refcounts[block] = count
            if count == 0:
                heapq.heappush(free, block)

    def __repr__(self) -> str:
        ext = (f", extension={self.num_extension_blocks}"
               f"{' (in use)' if self.expanded else ''}") if self.num_extension_blocks else ""
        return (f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks}, sequences={len(self._tables)}{ext})")
