"""Prefix caching in the block manager: hash-chain index, sharing, LRU eviction, per-pool bits,
rollback guard, elastic moves; and a randomized workload against a shadow of the KV pools."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jspec.block_manager import BlockManager


def _cached_bm(num_blocks=12, block_size=4, **kw) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_caching=True, **kw)


def _run(bm: BlockManager, rid: str, tokens: list[int], computed: int | None = None,
         draft: int = 0) -> list[int]:
    """Admit ``tokens`` as request ``rid``, compute ``computed`` of them (all but the last by
    default) for the target and ``draft`` for the draft, and offer the blocks to the cache."""
    cached = bm.match_prefix(rid, tokens)
    assert bm.allocate(rid, len(tokens))
    computed = len(tokens) - 1 if computed is None else computed
    bm.cache_blocks(rid, computed, [draft], lambda: tokens)
    return cached


def test_finished_request_blocks_are_reused_by_a_request_with_the_same_prefix():
    bm = _cached_bm()
    prompt = list(range(100, 111))  # 11 tokens: blocks 0-1 full, block 2 partial
    assert _run(bm, "a", prompt) == [0, 0]
    a_table = bm.block_table("a")
    bm.free("a")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 11  # cached blocks count as free
    cached = _run(bm, "b", prompt[:8] + [7, 7, 7])
    assert cached == [8, 0]  # the target's two blocks; the draft never computed them
    assert bm.block_table("b")[:2] == a_table[:2]
    bm.check_invariants()


def test_sharing_is_reference_counted_and_a_diverging_block_is_not_matched():
    bm = _cached_bm()
    _run(bm, "a", list(range(9)))
    assert _run(bm, "b", list(range(4)) + [50, 51, 52, 53, 54]) == [4, 0]
    assert bm.block_table("a")[0] == bm.block_table("b")[0]
    assert bm.block_table("a")[1] != bm.block_table("b")[1]
    assert bm._refcounts[bm.block_table("a")[0]] == 2
    bm.free("a")
    assert bm._refcounts[bm.block_table("b")[0]] == 1  # b still reads it
    bm.check_invariants()


def test_hash_is_a_chain_a_block_matches_only_after_the_same_prefix():
    bm = _cached_bm()
    _run(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.free("a")
    # the second block's tokens again, behind another first block: no hit
    assert _run(bm, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == [0, 0]


def test_whole_prompt_cached_leaves_the_last_token_to_compute():
    bm = _cached_bm()
    prompt = list(range(9))
    _run(bm, "a", prompt, computed=9)
    bm.free("a")
    assert _run(bm, "b", prompt[:8]) == [4, 0]  # 8 tokens: the second block holds the last one
    assert _run(bm, "c", prompt) == [8, 0]


def test_draft_pool_hits_stop_at_the_first_block_its_kv_does_not_cover():
    bm = _cached_bm(num_pool_models=2)
    prompt = list(range(13))
    bm.match_prefix("a", prompt)
    bm.allocate("a", 13)
    bm.cache_blocks("a", 12, [8, 4], lambda: prompt)  # draft 0 covers 2 blocks, draft 1 one
    bm.free("a")
    assert bm.match_prefix("b", prompt) == [12, 8, 4]
    # a later holder's draft catch-up marks the block for everyone after it
    bm.allocate("b", 13)
    bm.cache_blocks("b", 12, [12, 4], lambda: prompt)
    bm.free("b")
    assert bm.match_prefix("c", prompt) == [12, 12, 4]
    bm.forget_pool_models()  # elastic memory offloaded the drafts
    bm.free("c")
    assert bm.match_prefix("d", prompt) == [12, 0, 0]
    bm.check_invariants()


def test_eviction_is_least_recently_used_and_only_when_blocks_are_needed():
    bm = _cached_bm(num_blocks=7, block_size=2)  # 6 usable
    _run(bm, "old", [1, 1, 1, 1, 1])  # caches 2 blocks
    bm.free("old")
    _run(bm, "new", [2, 2, 2, 2, 2])
    bm.free("new")
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # 2 never-indexed blocks are taken first: nothing is evicted yet
    assert bm.allocate("x", 4) and bm.num_cached_blocks == 4
    # then the least recently used cached blocks go, a prompt's tail before its head
    assert bm.allocate("y", 2) and bm.num_cached_blocks == 3
    assert bm.match_prefix("p", [1, 1, 1, 1, 1]) == [2, 0]  # old's second block was evicted
    bm.free("p")
    assert bm.match_prefix("q", [2, 2, 2, 2, 2]) == [4, 0]
    bm.check_invariants()


def test_a_hit_refreshes_a_block_in_the_lru_order():
    bm = _cached_bm(num_blocks=5, block_size=2)  # 4 usable
    _run(bm, "a", [1, 1, 1])
    bm.free("a")
    _run(bm, "b", [2, 2, 2])
    bm.free("b")
    _run(bm, "c", [1, 1, 1])  # a's block is used again: now the most recent
    bm.free("c")
    assert bm.allocate("y", 2 * 3)  # the 2 never-indexed blocks, then one eviction: b's
    assert bm.match_prefix("f", [1, 1, 1]) == [2, 0]
    assert bm.match_prefix("g", [2, 2, 2]) == [0, 0]


def test_a_kept_hash_chain_is_reused_not_recomputed():
    bm = _cached_bm()
    tokens = list(range(9))
    _run(bm, "a", tokens)
    bm.free("a")
    chain: list[bytes] = []
    assert bm.match_prefix("b", tokens, chain) == [8, 0] and len(chain) == 2
    bm.free("b")  # refused admission or preemption: the sequence keeps its chain
    kept = list(chain)
    assert bm.match_prefix("b", tokens + [1] * 7, chain) == [8, 0]
    assert chain[:2] == kept and len(chain) == 4  # extended, the first two not recomputed
    bm.free("b")
    assert bm.match_prefix("c", tokens, [b"not this prefix"]) == [0, 0]  # taken as given


def _salted(bm: BlockManager, rid: str, tokens: list[int], salt: str | None) -> list[int]:
    """``_run`` for a request with prefix-cache salt ``salt``; returns its cached counts."""
    cached = bm.match_prefix(rid, tokens, cache_salt=salt)
    assert bm.allocate(rid, len(tokens))
    bm.cache_blocks(rid, len(tokens) - 1, [0], lambda: tokens, cache_salt=salt)
    return cached


def test_cache_salt_separates_tenants():
    """The same prompt under another salt (or with a salt against none) shares no block; the
    same salt shares, and no salt shares with no salt."""
    bm = _cached_bm(num_blocks=20)
    tokens = list(range(9))  # two full blocks
    assert _salted(bm, "a1", tokens, "tenant-a") == [0, 0]
    assert _salted(bm, "b1", tokens, "tenant-b") == [0, 0]
    assert _salted(bm, "none1", tokens, None) == [0, 0]
    assert _salted(bm, "a2", tokens, "tenant-a") == [8, 0]
    assert _salted(bm, "b2", tokens, "tenant-b") == [8, 0]
    assert _salted(bm, "none2", tokens, None) == [8, 0]
    for a, b in (("a1", "a2"), ("b1", "b2"), ("none1", "none2")):
        assert bm.block_table(a)[:2] == bm.block_table(b)[:2]
    assert len({tuple(bm.block_table(r)[:2]) for r in ("a1", "b1", "none1")}) == 3
    assert bm.num_cached_blocks == 6
    # the salt is in the first block's hash and the chain carries it: no later block matches
    # across salts either, even one whose own tokens are the same
    for rid in ("a1", "a2", "b1", "b2", "none1", "none2"):
        bm.free(rid)
    assert _salted(bm, "c", tokens, "tenant-c") == [0, 0]
    bm.check_invariants()


def test_rollback_may_not_release_a_cached_block():
    bm = _cached_bm()
    tokens = list(range(10))
    _run(bm, "a", tokens)  # blocks 0 and 1 cached
    bm.truncate("a", 9)  # drops nothing cached
    with pytest.raises(RuntimeError, match="cached block 1"):
        bm.truncate("a", 4)
    assert len(bm.block_table("a")) == 3


def test_concurrent_duplicate_block_stays_private():
    bm = _cached_bm()
    tokens = list(range(9))
    bm.match_prefix("a", tokens)
    bm.match_prefix("b", tokens)  # admitted before a computed anything
    bm.allocate("a", 9)
    bm.allocate("b", 9)
    bm.cache_blocks("a", 8, [0], lambda: tokens)
    bm.cache_blocks("b", 8, [0], lambda: tokens)
    assert bm.num_cached_blocks == 2
    bm.free("b")  # its duplicates go straight back to the free list
    assert bm.num_cached_blocks == 2
    bm.check_invariants()


def test_counting_and_caching_off():
    bm = _cached_bm()
    tokens = list(range(9))
    bm.count_query(9, _run(bm, "a", tokens))
    bm.count_query(9, _run(bm, "b", tokens))
    assert (bm.stats.queries, bm.stats.hits, bm.stats.draft_hits) == (18, 8, [0])
    assert bm.stats.hit_rate == pytest.approx(8 / 18)
    off = BlockManager(12, 4)
    _run(off, "a", tokens)
    off.free("a")
    assert _run(off, "b", tokens) == [0, 0] and off.num_cached_blocks == 0


def test_elastic_contraction_moves_cached_blocks_and_their_index():
    bm = _cached_bm(num_blocks=12, block_size=4, num_extension_blocks=5)  # base 1..6
    _run(bm, "fill", [0] * 24, computed=0)
    bm.expand()
    tokens = list(range(12))
    _run(bm, "a", tokens)  # blocks 7, 8, 9 (two cached)
    _run(bm, "idle", [5] * 5)  # one cached block in the extension, freed below
    bm.free("idle")
    bm.free("fill")
    moves = bm.contraction_plan()
    assert [s for s, _ in moves] == bm.block_table("a")
    bm.contract(moves)
    bm.check_invariants()
    assert bm.num_cached_blocks == 2  # idle's block was evicted with the extension
    bm.free("a")
    assert bm.match_prefix("b", tokens) == [8, 0]
    assert max(bm.block_table("b")) < bm.num_base_blocks


def test_contraction_takes_cached_free_base_blocks_when_no_other_is_free():
    bm = _cached_bm(num_blocks=8, block_size=2, num_extension_blocks=3)  # base 1-4, ext 5-7
    _run(bm, "a", [3] * 7)  # blocks 1-4, the first three cached
    bm.expand()
    assert bm.allocate("b", 4) and bm.block_table("b") == [5, 6]
    bm.free("a")  # 4 back to the free list; 3, 2, 1 cached and free (tail first)
    moves = bm.contraction_plan()
    assert moves == [(5, 4), (6, 3)]  # the never-indexed block, then the LRU cached one
    bm.contract(moves)
    bm.check_invariants()
    assert bm.num_cached_blocks == 2 and bm.block_table("b") == [4, 3]
    assert bm.match_prefix("c", [3] * 7) == [4, 0]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random requests over a two-token alphabet (prefixes collide all the time) against a
    shadow of every pool: each K/V slot holds the token prefix it was computed for. A hit must
    hand out blocks whose shadow matches the request's tokens, in every pool it counts; the
    target never writes into a cached or shared block; elastic moves carry the shadow along."""

    BS = 2

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(16, self.BS, num_extension_blocks=4, enable_caching=True,
                               num_pool_models=2)
        self.kv = [{}, {}, {}]  # pool -> (block, slot) -> prefix tuple
        self.reqs: dict[str, dict] = {}
        self.counter = 0

    def _write(self, pool: int, rid: str, pos: int, content) -> None:
        table = self.bm.block_table(rid)
        block = table[pos // self.BS]
        key = (block, pos % self.BS)
        if pool == 0:
            assert self.bm._block_hash[block] is None, "the target wrote into a cached block"
            assert self.bm._refcounts[block] == 1, "the target wrote into a shared block"
        elif self.bm._block_pools[block] >> (pool - 1) & 1:
            # a draft filling in a block another holder's draft already covered (its bit is
            # set) writes what is there
            assert self.kv[pool][key] == content
        self.kv[pool][key] = content

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def admit(self, tokens):
        rid = f"r{self.counter}"
        self.counter += 1
        cached = self.bm.match_prefix(rid, tokens)
        assert cached[0] <= len(tokens) - 1 and all(c % self.BS == 0 for c in cached)
        assert max(cached[1:]) <= cached[0]
        table = self.bm.block_table(rid)
        for pool, n in enumerate(cached):
            for pos in range(n):
                got = self.kv[pool].get((table[pos // self.BS], pos % self.BS))
                assert got == tuple(tokens[:pos + 1]), f"pool {pool} hit holds other K/V"
        if not self.bm.allocate(rid, len(tokens)):
            self.bm.free(rid)
            return
        self.bm.count_query(len(tokens), cached)
        self.reqs[rid] = {"tokens": list(tokens), "computed": list(cached)}

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), pool=st.sampled_from([0, 0, 1, 1, 2]), n=st.integers(1, 8))
    def compute(self, data, pool, n):
        if pool and self.bm.expanded:
            return  # the drafts are offloaded while the pool is expanded
        rid = self._pick(data)
        r = self.reqs[rid]
        tokens, computed = r["tokens"], r["computed"]
        limit = len(tokens) if pool == 0 else computed[0]
        end = min(computed[pool] + n, limit)
        for pos in range(computed[pool], end):
            self._write(pool, rid, pos, tuple(tokens[:pos + 1]))
        computed[pool] = max(computed[pool], end)
        self.bm.cache_blocks(rid, computed[0], computed[1:], lambda: tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=4),
          spec=st.integers(0, 3))
    def decode(self, data, new, spec):
        """Speculative K/V past the committed tokens, then commit ``new`` and roll back."""
        rid = self._pick(data)
        r = self.reqs[rid]
        tokens = r["tokens"]
        if r["computed"][0] < len(tokens) or not self.bm.allocate(rid, len(tokens) + spec):
            return
        for pos in range(len(tokens), len(tokens) + spec):
            self._write(0, rid, pos, ("speculative", pos))
        if not self.bm.allocate(rid, len(tokens) + len(new)):
            self.bm.truncate(rid, len(tokens))
            return
        tokens += new
        self.bm.truncate(rid, len(tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = self._pick(data)
        self.bm.free(rid)
        del self.reqs[rid]

    @precondition(lambda self: not self.bm.expanded)
    @rule()
    def expand(self):
        self.bm.expand()
        self.bm.forget_pool_models()
        self.kv[1].clear()
        self.kv[2].clear()
        for r in self.reqs.values():
            r["computed"][1:] = [0, 0]

    @precondition(lambda self: self.bm.expanded)
    @rule()
    def contract(self):
        moves = self.bm.contraction_plan()
        if moves is None:
            return
        kv = self.kv[0]
        for src, dst in moves:  # what migrate_blocks does to the pool
            for slot in range(self.BS):
                if (src, slot) in kv:
                    kv[(dst, slot)] = kv[(src, slot)]
                else:
                    kv.pop((dst, slot), None)
        self.bm.contract(moves)

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        held = {b for rid in self.reqs for b in self.bm.block_table(rid)}
        assert self.bm.num_used_blocks == len(held)


TestPrefixCacheStateful = PrefixCacheMachine.TestCase
TestPrefixCacheStateful.settings = settings(max_examples=100, stateful_step_count=80,
                                            deadline=None)


# ----------------------------------------------------------------------------- in the engine
# Greedy output with caching must equal target-only greedy output without it, whatever the
# cache hands out (fp32, tests/conftest.py's tiny models and shapes).

def _greedy(n):
    from jspec.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def conversation(mixed_prompts):
    """Prompts sharing prefixes: a 40-token system prompt (2.5 blocks of 16) before different
    questions, and second turns that repeat a first turn and its answer."""
    system = [5 + (7 * i) % 200 for i in range(40)]
    return system, [system + p[:12] for p in mixed_prompts[:6]]


def _reference(engine_models, prompts, max_tokens):
    from conftest import make_engine, run_to_completion

    target, _, _ = engine_models
    engine = make_engine(target, None, enable_prefix_caching=False)
    outs = run_to_completion(engine, prompts, _greedy(max_tokens))
    return [outs[str(i)].token_ids for i in range(len(prompts))]


def _waves(engine, waves, max_tokens):
    """Run each wave of prompts to completion before the next (later waves hit the cache)."""
    from conftest import run_to_completion

    outs = []
    for w, prompts in enumerate(waves):
        base = sum(map(len, waves[:w]))
        for i, p in enumerate(prompts):
            engine.add_request(str(base + i), p, _greedy(max_tokens))
        done = run_to_completion(engine, [], _greedy(max_tokens))
        outs += [done[str(base + i)] for i in range(len(prompts))]
    return outs


@pytest.mark.parametrize("gamma", [0, 3])
def test_shared_prefixes_give_the_target_only_output(engine_models, conversation, gamma):
    from conftest import make_engine

    target, draft, _ = engine_models
    system, first = conversation
    max_tokens = 20
    ref_first = _reference(engine_models, first, max_tokens)
    # second turns: a first turn, its answer and a follow-up; a block boundary falls inside
    # the answer, where the first turn's speculative writes were rolled back
    second = [p + r + [9, 8, 7] for p, r in zip(first, ref_first)]
    ref_second = _reference(engine_models, second, max_tokens)
    engine = make_engine(target, draft, policy_options=(("gamma", gamma),))
    outs = _waves(engine, [first[:1], first[1:], second], max_tokens)
    assert [o.token_ids for o in outs] == ref_first + ref_second
    m = engine.metrics.as_dict()
    # wave 2 reuses the system prompt's 2 full blocks; wave 3 each first turn's blocks
    assert [o.num_cached_tokens for o in outs[1:6]] == [32] * 5
    assert all(o.num_cached_tokens >= 48 for o in outs[6:])
    assert m["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outs)
    assert m["prefix_cache_queries"] == sum(map(len, first + second))
    if gamma:  # the draft caught up on the first turns: its pool has the blocks too
        assert m["prefix_cache_draft_hits"][0] > 0
    stats = engine.stats()
    assert stats.kv_blocks_cached > 0 and stats.kv_blocks_used == 0
    engine.block_manager.check_invariants()


def test_rollback_after_a_shared_boundary_with_a_draft_that_always_misses(engine_models,
                                                                           conversation):
    """Every speculative step is rejected and rolled back, starting right after the cached
    blocks: rollback must drop only the request's own tail (the block manager raises if a
    cached block would go)."""
    from conftest import make_engine

    target, _, unrelated = engine_models
    system, first = conversation
    prompts = [system[:32] + [11], system[:32] + [12, 13]]  # the hit ends on a block boundary
    ref = _reference(engine_models, prompts, 24)
    engine = make_engine(target, unrelated, policy_options=(("gamma", 3),))
    outs = _waves(engine, [[system[:33]], prompts], 24)
    assert [o.token_ids for o in outs[1:]] == ref
    assert [o.num_cached_tokens for o in outs[1:]] == [32, 32]
    assert engine.metrics.acceptance_rate < 0.2
    engine.block_manager.check_invariants()


def test_preempted_and_aborted_sharers(engine_models, conversation):
    """A pool too small for the batch: sharers of the system prompt are preempted (their blocks
    stay cached and come back on readmission) and some are aborted mid-way; the others still
    produce the target-only output and nothing leaks."""
    from conftest import make_engine

    target, draft, _ = engine_models
    system, first = conversation
    prompts = [system + p[:30] for p in first] + [system + [3] * 20]
    max_tokens = 40
    ref = _reference(engine_models, prompts, max_tokens)
    engine = make_engine(target, draft, policy_options=(("gamma", 3),), num_kv_blocks=14)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _greedy(max_tokens))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:
            engine.abort_request(["1", "4"])
        engine.scheduler.check_invariants()
    assert engine.metrics.num_preemptions > 0
    assert done["1"].finish_reason == done["4"].finish_reason == "abort"
    for i, r in enumerate(ref):
        if i not in (1, 4):
            assert done[str(i)].token_ids == r, f"prompt {i}"
    assert engine.metrics.prefix_cache.hits > 0
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_cache_salt_in_the_engine(engine_models, conversation):
    """Requests with the same prompt: hits only among those with the same salt, counted in
    the prefix-cache metrics, and the output is the same whatever the cache hands out."""
    from conftest import make_engine, run_to_completion

    target, draft, _ = engine_models
    system, first = conversation
    prompt = first[0]
    engine = make_engine(target, draft, policy_options=(("gamma", 3),))
    salts = [None, "tenant-a", "tenant-b", "tenant-a", None, "tenant-b"]
    outs = []
    for i, salt in enumerate(salts):  # one at a time, so each finds the earlier ones cached
        engine.add_request(str(i), prompt, _greedy(8), cache_salt=salt)
        outs.append(run_to_completion(engine, [], _greedy(8))[str(i)])
    full = (len(prompt) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, full, full, full]
    assert engine.metrics.prefix_cache.hits == 3 * full
    assert len({tuple(o.token_ids) for o in outs}) == 1
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string, got an integer"):
        engine.add_request("bad", prompt, _greedy(8), cache_salt=5)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string, got an empty"):
        engine.add_request("bad", prompt, _greedy(8), cache_salt="")
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()


def test_chains_each_pool_model_reuses_its_own_cached_kv(engine_models, conversation):
    """A pool of two drafts under random chains: each model's K/V of a cached block is reused
    only where that model had computed it (its own bit), and the output stays the target's."""
    from conftest import make_engine
    from test_chains import RandomChainPolicy

    target, agreeing, small = engine_models
    system, first = conversation
    max_tokens = 16
    second = [p + [9, 8, 7] for p in first[:3]]
    ref = _reference(engine_models, first[:3] + second, max_tokens)
    engine = make_engine(target, [agreeing, small], policy=RandomChainPolicy(7, seed=1))
    outs = _waves(engine, [first[:3], second], max_tokens)
    assert [o.token_ids for o in outs] == ref
    m = engine.metrics.as_dict()
    assert m["prefix_cache_hits"] > 0
    assert all(0 < h <= m["prefix_cache_hits"] for h in m["prefix_cache_draft_hits"])
    engine.block_manager.check_invariants()
