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
array allocated only while the pool is expanded (``jspec.kernels.segments``). They are reserved,
outside the free list, until :meth:`expand` hands them out; :meth:`contraction_plan` and
:meth:`contract` move every live block out of the extension again and take it back.

Prefix caching (``enable_caching``; vLLM's automatic prefix caching): a *full* block whose
target K/V is computed is registered in an index under a hash chain over its tokens (SHA-256 of
the previous block's hash and this block's token ids, seeded with ``namespace``), so the key
names the whole prefix up to the block's end. A request's ``cache_salt`` (vLLM's per-request
salt) is mixed into its first block's hash only, and the chain carries it to every later block:
requests share cached blocks only when they give the same salt (or both none), so one tenant
cannot learn from a fast prefill that another sent the same prefix. A request without a table
first takes the longest chain of indexed blocks its tokens start with (:meth:`match_prefix`,
reference counted: several requests read one block), and its prefill starts after them. Indexed blocks stay indexed when the
last table lets them go: they wait, in least-recently-used order, among the free blocks
(``num_free_blocks`` counts them) and are evicted only when an allocation finds no never-indexed
block left. An indexed block is never written by the target again (its tokens are all committed
and every later write lands at a higher position), and :meth:`truncate` refuses to release one,
so speculative rollback only ever drops a request's own unshared tail.

The draft pool models' K/V of a block may or may not exist (a draft lags the target after γ = 0
steps and loses its K/V when elastic memory offloads it), so each indexed block also carries one
bit per pool model, set once a holder's draft K/V covers the block; a hit reports each pool's own
cached length (the leading blocks with its bit set), and the draft catches up from there. A draft
catching up may write into a shared block whose bit is not set yet: it writes the K/V of the same
tokens at the same positions that any other holder would, so readers are unaffected.

Free-list policy: lowest free block id first (a min-heap). Keeping live blocks packed at low ids
means that an expanded pool uses the extension only once the base is full, and contraction has as
few live blocks to migrate out of it as possible. The cost is O(log n) per block handed out or
returned, and blocks change hands only at block boundaries (about once every ``block_size``
tokens per sequence).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
from collections.abc import Callable, Hashable, Sequence

import numpy as np

NULL_BLOCK = 0


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens, counted once per admitted request (vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``): ``queries`` are the requests' tokens
    looked up, ``hits`` those the target pool had cached, ``draft_hits[m]`` those pool model m
    had cached (at most ``hits``)."""

    num_pool_models: int = 1
    queries: int = 0
    hits: int = 0
    draft_hits: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.draft_hits:
            self.draft_hits = [0] * self.num_pool_models

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class BlockManager:
    """Allocates physical KV blocks to sequences (keyed by request id), with reference counts.

    Reference counts exist because prefix caching lets several sequences share blocks; a block
    returns to the free list only when the last table holding it lets it go. ``num_pool_models``
    is how many draft pool models keep K/V over the same block ids (their cache bits).
    """

    def __init__(self, num_blocks: int, block_size: int, num_extension_blocks: int = 0, *,
                 enable_caching: bool = False, num_pool_models: int = 1,
                 namespace: bytes = b"") -> None:
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
        # prefix caching: hash -> block and back, and per block the pool models whose K/V of it
        # are valid (bit m); indexed blocks no table holds, least recently used first
        self.enable_caching = enable_caching
        self.num_pool_models = num_pool_models
        self._root = hashlib.sha256(b"jspec-prefix-cache\0" + namespace).digest()
        self._index: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_pools: list[int] = [0] * num_blocks
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        # per request: the hash chain of its full blocks so far, how many leading blocks of its
        # table were offered to the index, and per pool model how many were marked
        self._hashes: dict[Hashable, list[bytes]] = {}
        self._num_indexed: dict[Hashable, int] = {}
        self._pool_marked: dict[Hashable, list[int]] = {}
        self.stats = PrefixCacheStats(num_pool_models)

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
        """Blocks an allocation may take: never-indexed ones and cached ones no table holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index (held by tables or waiting to be reused)."""
        return len(self._index)

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
        if missing > len(free) + len(self._evictable):
            return False
        if table is None:
            table = self._tables[request_id] = []
        refcounts = self._refcounts
        for _ in range(missing):
            # a never-indexed block first: a cached one is evicted only when none is left
            block = heapq.heappop(free) if free else self._evict_lru()
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
        if keep < self._num_indexed.get(request_id, 0):
            raise RuntimeError(
                f"truncating request {request_id!r} to {num_slots} slots would release its "
                f"cached block {keep} (committed K/V, possibly shared); rollback may only drop "
                f"the unshared tail")
        self._release(table[keep:])
        del table[keep:]

    def free(self, request_id: Hashable) -> None:
        """Drop the sequence's table; its blocks are freed unless another table still holds them."""
        table = self._table(request_id)
        # the tail first: a prompt's later blocks are evicted before the prefix others share
        self._release(table[::-1])
        del self._tables[request_id]
        self._table_arrays.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_indexed.pop(request_id, None)
        self._pool_marked.pop(request_id, None)

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, request_id: Hashable, token_ids: Sequence[int],
                     hashes: list[bytes] | None = None, cache_salt: str | None = None
                     ) -> list[int]:
        """Give a request without a table the longest run of cached blocks its tokens start
        with (shared, reference counted) and return how many of its tokens each pool holds:
        ``[target, pool model 0, ...]`` (multiples of ``block_size``; a pool model's count
        stops at the first block its K/V do not cover). At most ``len(token_ids) - 1`` tokens
        are matched: the last one is fed again for its logits. Counts nothing (see
        :meth:`count_query`); undo with :meth:`free`.

        ``hashes``: the request's hash chain so far, extended in place and used from then on
        (a sequence's tokens only grow, so a caller that keeps it hashes each block once, also
        across preemptions and refused admissions). ``cache_salt``: the request's salt; it
        must be the same in every call for the request, :meth:`cache_blocks`' included."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        bs = self.block_size
        table = self._tables[request_id] = []
        if self.enable_caching:
            hashes = self._hashes[request_id] = self._chain(
                [] if hashes is None else hashes, token_ids, len(token_ids) // bs, cache_salt)
            index = self._index
            for h in hashes[:(len(token_ids) - 1) // bs]:
                block = index.get(h)
                if block is None:
                    break
                table.append(block)
        refcounts, evictable = self._refcounts, self._evictable
        for block in table:
            if not refcounts[block]:
                del evictable[block]
            refcounts[block] += 1
        self._mirror(request_id, table, 0)
        self._num_indexed[request_id] = len(table)
        marked = self._pool_marked[request_id] = []
        for m in range(self.num_pool_models):
            bit, n = 1 << m, 0
            while n < len(table) and self._block_pools[table[n]] & bit:
                n += 1
            marked.append(n)
        return [len(table) * bs] + [n * bs for n in marked]

    def count_query(self, num_tokens: int, cached: Sequence[int]) -> None:
        """Count an admitted request's lookup: ``num_tokens`` queried, ``cached`` as
        :meth:`match_prefix` returned it."""
        stats = self.stats
        stats.queries += num_tokens
        stats.hits += cached[0]
        for m, n in enumerate(cached[1:]):
            stats.draft_hits[m] += n

    def cache_blocks(self, request_id: Hashable, num_computed: int,
                     pool_computed: Sequence[int],
                     token_ids: Callable[[], Sequence[int]],
                     cache_salt: str | None = None) -> None:
        """Index the request's full blocks whose target K/V are computed (its first
        ``num_computed`` tokens) and mark those pool model m covers (``pool_computed[m]``
        tokens). Cheap when no model's K/V reached a new block since the last call (most decode
        steps); ``token_ids()`` is called only when a new block must be hashed. A block whose
        hash is indexed already (another request computed the same prefix meanwhile) stays
        private and is freed as usual."""
        if not self.enable_caching:
            return
        bs = self.block_size
        done = self._num_indexed.get(request_id, 0)
        marked = self._pool_marked.get(request_id)
        if num_computed // bs <= done and marked is not None:
            for m, c in zip(marked, pool_computed):
                if m < done and m < c // bs:
                    break
            else:
                return  # nothing new to index or mark
        table = self._table(request_id)
        n_full = min(num_computed // bs, len(table))
        if n_full > done:
            hashes = self._hashes.setdefault(request_id, [])
            if len(hashes) < n_full:
                self._chain(hashes, token_ids(), n_full, cache_salt)
            index, block_hash = self._index, self._block_hash
            for i in range(done, n_full):
                h, block = hashes[i], table[i]
                if block_hash[block] is None and h not in index:
                    index[h] = block
                    block_hash[block] = h
            self._num_indexed[request_id] = done = n_full
        if marked is None:
            marked = self._pool_marked[request_id] = [0] * self.num_pool_models
        hashes = self._hashes.get(request_id, ())
        for m in range(self.num_pool_models):
            upto = min(pool_computed[m] // bs, done)
            if upto > marked[m]:
                bit = 1 << m
                for i in range(marked[m], upto):
                    block = table[i]
                    if self._block_hash[block] == hashes[i]:  # this request's block is indexed
                        self._block_pools[block] |= bit
                marked[m] = upto

    def reset_prefix_cache(self) -> int:
        """Empty the index (vLLM's ``reset_prefix_cache``): cached free blocks return to the
        free list and blocks requests hold become private. Returns how many were indexed."""
        n = len(self._index)
        for block in self._index.values():
            self._block_hash[block] = None
            self._block_pools[block] = 0
        self._index.clear()
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        return n

    def forget_pool_models(self) -> None:
        """Every pool model's K/V are gone (elastic memory offloaded the draft): clear their
        bits; the target's cached blocks stay."""
        self._block_pools = [0] * self.num_blocks
        for marked in self._pool_marked.values():
            marked[:] = [0] * len(marked)

    def _chain(self, hashes: list[bytes], token_ids: Sequence[int], n: int,
               cache_salt: str | None) -> list[bytes]:
        """Extend ``hashes`` (the chain of the first len(hashes) blocks) to ``n`` blocks."""
        bs = self.block_size
        if hashes:
            prev = hashes[-1]
        elif cache_salt is None:
            prev = self._root
        else:  # the salt enters the first block's hash; each later hash contains it
            prev = hashlib.sha256(b"jspec-cache-salt\0" + self._root
                                  + cache_salt.encode("utf-8", "surrogatepass")).digest()
        for i in range(len(hashes), n):
            tokens = np.asarray(token_ids[i * bs:(i + 1) * bs], np.int64)
            prev = hashlib.sha256(prev + tokens.tobytes()).digest()
            hashes.append(prev)
        return hashes

    def _evict_lru(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        self._unindex(block)
        return block

    def _unindex(self, block: int) -> None:
        del self._index[self._block_hash[block]]
        self._block_hash[block] = None
        self._block_pools[block] = 0

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
        a free base block, never-indexed ones lowest first, then cached ones no table holds,
        least recently used first (they are evicted) (§5.3 steps 1-2). ``None`` when the free
        base blocks cannot take them all. Sources are live and destinations free, so the two
        sets are disjoint and the copies commute (``jspec.kernels.kv_migration``)."""
        if not self.expanded:
            raise RuntimeError("the KV pool is not expanded")
        base = self.num_base_blocks
        live = sorted(b for b in range(base, self.num_blocks) if self._refcounts[b])
        free_base = sorted(b for b in self._free if b < base)
        if len(free_base) < len(live):
            free_base += [b for b in self._evictable if b < base][:len(live) - len(free_base)]
        if len(live) > len(free_base):
            return None
        return list(zip(live, free_base))

    def contract(self, moves: list[tuple[int, int]]) -> None:
        """Apply a :meth:`contraction_plan` to the tables and the prefix-cache index (after the
        K/V were copied) and take the extension back (§5.3 steps 3 and 5); cached extension
        blocks no table holds are evicted."""
        if not self.expanded:
            raise RuntimeError("the KV pool is not expanded")
        base = self.num_base_blocks
        remap = dict(moves)
        live = {b for b in range(base, self.num_blocks) if self._refcounts[b]}
        if set(remap) != live:
            raise ValueError(f"the moves cover extension blocks {sorted(remap)} but the live "
                             f"ones are {sorted(live)}")
        free_set = set(self._free)
        evictable = self._evictable
        for src, dst in moves:
            if not (dst < base and (dst in free_set or dst in evictable)):
                raise ValueError(f"destination block {dst} is not a free base block")
            if dst in evictable:
                del evictable[dst]
                self._unindex(dst)
            free_set.discard(dst)
            self._refcounts[dst], self._refcounts[src] = self._refcounts[src], 0
            h = self._block_hash[src]
            if h is not None:  # the index follows the block
                self._index[h] = dst
                self._block_hash[dst], self._block_hash[src] = h, None
                self._block_pools[dst], self._block_pools[src] = self._block_pools[src], 0
        for block in [b for b in evictable if b >= base]:
            del evictable[block]
            self._unindex(block)
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
        evictable = self._evictable
        if used + len(free) + len(evictable) != self.num_usable_blocks:
            raise AssertionError(f"{used} used + {len(free)} free + {len(evictable)} cached "
                                 f"free != {self.num_usable_blocks} usable blocks (leaked "
                                 f"blocks)")
        block_hash = self._block_hash
        for block in evictable:
            if holders[block] or block in free_set or block_hash[block] is None \
                    or not 0 < block < limit:
                raise AssertionError(f"cached free block {block} is held, in the free list, "
                                     f"not indexed or out of range")
        for block in free:
            if block_hash[block] is not None:
                raise AssertionError(f"block {block} in the free list is still indexed")
        for h, block in self._index.items():
            if block_hash[block] != h:
                raise AssertionError(f"the index maps a hash to block {block}, which has "
                                     f"another")
        indexed = sum(1 for h in block_hash if h is not None)
        if indexed != len(self._index):
            raise AssertionError(f"{indexed} blocks carry a hash but the index holds "
                                 f"{len(self._index)}")
        for block, bits in enumerate(self._block_pools):
            if bits and block_hash[block] is None:
                raise AssertionError(f"block {block} has pool bits but is not indexed")
        for request_id, table in self._tables.items():
            arr = self._table_arrays.get(request_id)
            if table and (arr is None or arr[:len(table)].tolist() != table):
                raise AssertionError(f"stale page-table mirror for request {request_id!r}")
        for request_id, table in self._tables.items():
            n = self._num_indexed.get(request_id, 0)
            if n > len(table):
                raise AssertionError(f"request {request_id!r} indexed {n} blocks but holds "
                                     f"{len(table)}")
        extra = (set(self._table_arrays) | set(self._hashes) | set(self._num_indexed)
                 | set(self._pool_marked)) - set(self._tables)
        if extra:
            raise AssertionError(f"page-table mirrors or hash chains of freed requests "
                                 f"{sorted(map(repr, extra))}")

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
        block_hash = self._block_hash
        for block in blocks:
            count = refcounts[block] - 1
            refcounts[block] = count
            if count == 0:
                if block_hash[block] is None:
                    heapq.heappush(free, block)
                else:  # cached: kept for reuse, the most recently used
                    self._evictable[block] = None

    def __repr__(self) -> str:
        ext = (f", extension={self.num_extension_blocks}"
               f"{' (in use)' if self.expanded else ''}") if self.num_extension_blocks else ""
        cached = f", cached={self.num_cached_blocks}" if self.enable_caching else ""
        return (f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks}, sequences={len(self._tables)}{cached}{ext})")
