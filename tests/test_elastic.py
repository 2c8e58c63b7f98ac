"""Elastic memory (Nightjar §5): the block manager's extension, the expand/contract controller,
the runner's draft offload and reload, and the engine driving forced cycles losslessly."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import ENGINE_VOCAB, make_engine, run_to_completion
from hypothesis import settings
from hypothesis.stateful import precondition, rule

from jspec import runner
from jspec.block_manager import BlockManager
from jspec.elastic import DraftState, ElasticMemory, extension_blocks
from jspec.sampling_params import SamplingParams
from jspec.policies.base import DraftPlan
from jspec.policies.static import StaticPolicy
from test_block_manager import BlockManagerMachine


# ----------------------------------------------------------------------------- block manager
def test_extension_blocks_are_reserved_until_expand():
    bm = BlockManager(12, 4, num_extension_blocks=5)
    assert (bm.num_base_blocks, bm.num_usable_blocks, bm.num_free_blocks) == (7, 6, 6)
    assert not bm.allocate("a", 7 * 4)  # 7 blocks do not fit in the base
    assert bm.allocate("a", 6 * 4) and max(bm.block_table("a")) == 6
    bm.check_invariants()
    assert bm.expand() == 5
    assert (bm.num_usable_blocks, bm.num_free_blocks, bm.num_base_usable_blocks) == (11, 5, 6)
    assert bm.allocate("b", 3 * 4) and bm.block_table("b") == [7, 8, 9]
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="already expanded"):
        bm.expand()


def test_expanded_pool_prefers_base_blocks():
    bm = BlockManager(10, 2, num_extension_blocks=4)
    bm.allocate("a", 2 * 5)  # the whole base
    bm.expand()
    bm.allocate("b", 2)
    bm.free("a")
    bm.allocate("c", 2 * 2)
    assert bm.block_table("c") == [1, 2]  # lowest first: the base again


def test_contraction_moves_live_blocks_into_free_base_blocks():
    bm = BlockManager(12, 4, num_extension_blocks=5, enable_caching=True)
    bm.allocate("a", 6 * 4)
    bm.expand()
    tokens = list(range(3 * 4))
    bm.match_prefix("b", tokens)
    bm.allocate("b", 3 * 4)  # 7, 8, 9
    bm.cache_blocks("b", 12, [0], lambda: tokens)
    assert bm.match_prefix("b2", tokens + [0]) == [12, 0]  # a shared block moves once, for both
    assert bm.contraction_plan() is None  # no free base block yet
    bm.free("a")
    moves = bm.contraction_plan()
    assert moves == [(7, 1), (8, 2), (9, 3)]
    srcs, dsts = {s for s, _ in moves}, {d for _, d in moves}
    assert not srcs & dsts
    bm.contract(moves)
    assert not bm.expanded and bm.block_table("b") == [1, 2, 3] == bm.block_table("b2")
    assert bm.num_usable_blocks == 6 and bm.num_free_blocks == 3 and bm.num_cached_blocks == 3
    bm.check_invariants()
    out = np.zeros((1, 4), np.int32)
    bm.fill_page_table(out, 0, "b")
    assert out[0, :3].tolist() == [1, 2, 3]
    bm.free("b")
    bm.free("b2")
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_contract_rejects_a_plan_that_misses_live_blocks():
    bm = BlockManager(8, 2, num_extension_blocks=3)
    bm.allocate("a", 2 * 4)
    bm.expand()
    bm.allocate("b", 2 * 2)  # 5, 6
    bm.free("a")
    with pytest.raises(ValueError, match="live ones"):
        bm.contract([(5, 1)])
    with pytest.raises(ValueError, match="not a free base block"):
        bm.contract([(5, 1), (6, 6)])


def test_extension_size_is_validated():
    with pytest.raises(ValueError, match="num_extension_blocks"):
        BlockManager(4, 2, num_extension_blocks=3)


def test_invariants_catch_a_reserved_block_in_the_free_list():
    bm = BlockManager(8, 2, num_extension_blocks=3)
    bm._free.append(7)
    with pytest.raises(AssertionError, match="out-of-range"):
        bm.check_invariants()


class ElasticBlockManagerMachine(BlockManagerMachine):
    """The random workload of test_block_manager with expansions and contractions mixed in:
    a contraction must keep every table's contents (what its blocks held) in the same order."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=13, block_size=3, num_extension_blocks=5)

    @precondition(lambda self: not self.bm.expanded)
    @rule()
    def expand(self):
        self.bm.expand()

    @precondition(lambda self: self.bm.expanded)
    @rule()
    def contract(self):
        moves = self.bm.contraction_plan()
        if moves is None:
            return
        content = {b: ("data", b) for rid in self.model for b in self.bm.block_table(rid)}
        before = {rid: [content[b] for b in self.bm.block_table(rid)] for rid in self.model}
        for src, dst in moves:  # what migrate_blocks does to the pool
            assert dst not in content
            content[dst] = content[src]
        self.bm.contract(moves)
        for rid in self.model:
            table = self.bm.block_table(rid)
            assert max(table, default=0) < self.bm.num_base_blocks
            assert [content[b] for b in table] == before[rid]


TestElasticBlockManagerStateful = ElasticBlockManagerMachine.TestCase
TestElasticBlockManagerStateful.settings = settings(max_examples=60, stateful_step_count=40,
                                                    deadline=None)


# ----------------------------------------------------------------------------- controller
def test_extension_is_the_drafts_bytes_in_target_blocks():
    # 1000 bytes of weights + 10 blocks x 50 bytes of draft KV = 1500 bytes = 7 blocks of 200
    assert extension_blocks(1000, 50, 200, 10) == 7


def test_controller_expands_after_persisting_scarcity_and_contracts_with_hysteresis():
    e = ElasticMemory(num_base_usable=100, num_extension=30, low_watermark=0.1, persist_steps=3)
    assert e.tau_low == 10
    for _ in range(2):
        e.observe_step(True, 0, 5)
    e.observe_step(False, 0, 50)  # a prefill-only step neither counts nor breaks the streak
    assert not e.should_expand()
    e.observe_step(True, 2, 5)  # speculation on: the streak starts again
    for _ in range(2):
        e.observe_step(True, 0, 5)
    assert not e.should_expand()
    e.observe_step(True, 0, 9)
    assert e.should_expand()
    e.expanded_now()
    assert e.state is DraftState.OFFLOADED and not e.draft_resident
    assert not e.should_contract(num_free=40, num_waiting=0)  # needs > 30 + 10
    assert not e.should_contract(num_free=60, num_waiting=1)
    assert e.should_contract(num_free=41, num_waiting=0)
    e.contracted_now()
    assert e.state is DraftState.RELOADING and not e.draft_resident and not e.should_expand()
    e.reloaded_now()
    assert e.draft_resident


def test_a_kv_bound_queue_counts_like_gamma_zero():
    """Deviation from §5.1: requests waiting for KV while speculation still pays at the small
    batch the pool allows also build the streak (see jspec/elastic.py)."""
    e = ElasticMemory(num_base_usable=20, num_extension=80, low_watermark=0.1, persist_steps=2)
    e.observe_step(True, 4, 0)  # γ > 0, nothing waiting for KV: no streak
    e.observe_step(True, 4, 0)
    assert not e.should_expand()
    e.observe_step(True, 4, 0, kv_bound_queue=True)
    e.observe_step(True, 4, 1, kv_bound_queue=True)
    assert e.should_expand()
    e2 = ElasticMemory(num_base_usable=20, num_extension=80, low_watermark=0.1, persist_steps=1)
    e2.observe_step(True, 4, 5, kv_bound_queue=True)  # blocks are not short: no
    assert not e2.should_expand()


def test_controller_validates():
    with pytest.raises(ValueError, match="extension block"):
        ElasticMemory(10, 0)
    with pytest.raises(ValueError, match="persist_steps"):
        ElasticMemory(10, 3, persist_steps=0)


# ----------------------------------------------------------------------------- engine
ELASTIC_KW = dict(num_kv_blocks=24, elastic_memory=True, elastic_persist_steps=2,
                  elastic_low_watermark=0.3)


class LoadPolicy(StaticPolicy):
    """γ = 3 while nothing waits, 0 under a queue: what an adaptive policy does under a burst,
    so a burst expands the pool and its drain contracts it and resumes speculation."""

    def plan(self, view):
        gamma = 3 if view.draft_resident and view.num_waiting == 0 else 0
        return DraftPlan(gammas=np.full(view.num_decode, gamma, np.int32))


def _burst(seed: int = 0, n: int = 14):
    """Prompts of 21-39 tokens that share their first 20 (a cached block, with the prefix
    cache on as by default: the index must follow the blocks a contraction moves)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, ENGINE_VOCAB, 20).tolist()
    return [shared + rng.integers(3, ENGINE_VOCAB, max(1, int(k) - 20)).tolist()
            for k in rng.integers(5, 40, n)]


def _drive(engine, prompts, sampling_params):
    done, states = {}, []
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sampling_params)
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_invariants()
        engine.scheduler.check_invariants()
        drafted = int(engine.last_outcome.num_drafted.sum()) if engine.last_outcome else 0
        states.append((engine.elastic.state, drafted))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    return done, states


def test_elastic_needs_a_draft(engine_models):
    target, _, _ = engine_models
    with pytest.raises(ValueError, match="needs a draft"):
        make_engine(target, None, elastic_memory=True, warmup=False)


def test_engine_config_validates_elastic_options():
    from jspec.config import EngineConfig

    with pytest.raises(ValueError, match="elastic_low_watermark"):
        EngineConfig(elastic_low_watermark=1.5)
    with pytest.raises(ValueError, match="elastic_persist_steps"):
        EngineConfig(elastic_persist_steps=0)
    with pytest.raises(ValueError, match="elastic_pool_layout must be one of"):
        EngineConfig(elastic_pool_layout="ring")
    from jspec.config import resolve_elastic_pool_layout

    assert resolve_elastic_pool_layout("auto") == "preallocated"  # this CPU
    assert resolve_elastic_pool_layout("segments") == "segments"


@pytest.fixture(scope="module")
def elastic_engine(engine_models):
    """The accelerators' layout (the extension a second array), forced on this CPU."""
    target, draft, _ = engine_models
    return make_engine(target, draft, policy=LoadPolicy(7, 3), elastic_pool_layout="segments",
                       **ELASTIC_KW)


@pytest.mark.parametrize("layout", ["segments", "preallocated"])
def test_forced_cycles_are_lossless_and_compile_nothing(engine_models, elastic_engine, layout):
    """A burst on a pool too small for it: the engine expands (draft offloaded, γ forced to 0),
    contracts when the queue drains (live blocks migrated, draft reloaded, its KV caught up),
    speculates again, and the greedy output equals plain target decoding token for token. Both
    layouts of the extension: a second array (GPU/TPU) and one preallocated array (CPU)."""
    target, draft, _ = engine_models
    prompts = _burst()
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = run_to_completion(make_engine(target, None, num_kv_blocks=24), prompts, sp)
    engine = elastic_engine if layout == "segments" else make_engine(
        target, draft, policy=LoadPolicy(7, 3), elastic_pool_layout=layout, **ELASTIC_KW)
    assert engine.runner.extension_layout == layout
    before = runner.compile_events()
    done, states = _drive(engine, prompts, sp)
    assert runner.compile_events() == before, "an expand/contract cycle compiled"
    m = engine.metrics
    assert m.num_pool_expansions >= 1 and m.num_pool_contractions >= 1
    assert m.num_migrated_blocks >= 1  # the contraction really moved live blocks
    # speculation resumed after a reload, the draft catching up on whole contexts first
    first_offload = next(i for i, (s, _) in enumerate(states) if s is DraftState.OFFLOADED)
    assert any(drafted for _, drafted in states[first_offload:])
    assert m.catch_up_tokens > 0
    # the shared block came from the cache (not for the first prompts: admitted together, none
    # of them had finished it yet)
    assert m.prefix_cache.hits >= 16 * (len(prompts) // 2)
    for rid, out in expected.items():
        assert done[rid].token_source == out.token_source, rid


def test_offloaded_draft_is_never_run(elastic_engine):
    """While the draft is away every planned γ is 0 and the runner refuses to draft."""
    engine = elastic_engine
    seen_offloaded = []

    def check(outcome):
        if not engine.draft_resident:
            seen_offloaded.append(True)
            assert not outcome.gammas.any() and engine.stats().draft_resident is False

    engine.add_step_listener(check)
    try:
        _drive(engine, _burst(seed=3), SamplingParams(max_tokens=30, temperature=0.0,
                                                      ignore_eos=True))
    finally:
        engine.remove_step_listener(check)
    assert seen_offloaded


def _reload_lands_at_once(engine) -> None:
    """The draft's reload waited for at the first check: a reload otherwise lands at whichever
    step its copy finishes by, so on a busy machine two runs speculate from different steps, and
    a seeded request's draws (keyed by its length at each step) differ with them."""
    runner_ = engine.runner
    check = runner_.draft_ready

    def ready() -> bool:
        if not runner_.draft_resident and runner_.draft_kv is not None:
            jax.block_until_ready((runner_.draft.params, runner_.draft_kv))
        return check()

    runner_.draft_ready = ready


def test_sampling_with_seeds_is_reproducible_across_cycles(elastic_engine, engine_models):
    """Seeded sampling through expand/contract cycles: the same outputs and the same cycles on a
    second run (with the reload landing at a fixed step, every step's plan repeats, and a seed
    fixes every draw)."""
    sp = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    target, draft, _ = engine_models
    runs, cycles = [], []
    for _ in range(2):
        engine = make_engine(target, draft, policy=LoadPolicy(7, 3), **ELASTIC_KW)
        _reload_lands_at_once(engine)
        done, states = _drive(engine, _burst(seed=5), sp)
        assert engine.metrics.num_pool_expansions >= 1
        runs.append({k: v.token_source for k, v in done.items()})
        cycles.append(states)
    assert cycles[0] == cycles[1]
    assert runs[0] == runs[1]


def test_stats_and_limits_report_the_pool(elastic_engine):
    engine = elastic_engine
    limits = engine.limits
    assert limits.num_kv_blocks == 23 and limits.num_kv_extension_blocks > 0
    assert engine.stats().kv_blocks_total == 23
    assert limits.kv_capacity_tokens == 23 * 16  # a request must fit without the extension


def _device_bytes_live() -> int:
    import gc

    import jax

    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays()
               if not a.is_deleted() and a.sharding.memory_kind in (None, "device"))


def test_expansion_hands_device_memory_over(engine_models):
    """The trade is physical: the extension segment is allocated only once the draft's weights
    and KV pool have left device memory, and dropped before they come back, so the device
    bytes of (target KV, draft weights, draft KV) never exceed what the engine started with;
    counted from the runner's pools and from every live device array in the process."""
    import jax
    import jax.numpy as jnp

    from jspec.runner import LoadedModel

    target, draft, _ = engine_models
    # a draft only the engine holds, as LLM(...) builds it (the fixture keeps its own alive)
    own = LoadedModel(draft.cfg, jax.tree_util.tree_map(jnp.copy, draft.params), draft.name)
    engine = make_engine(target, own, policy=LoadPolicy(7, 3), elastic_pool_layout="segments",
                         **ELASTIC_KW)
    del own
    traded = ("target_kv", "draft_params", "draft_kv")
    start = engine.runner.device_bytes()
    budget = sum(start[k] for k in traded)
    live0 = _device_bytes_live()
    seen = []

    def check(outcome):
        now = engine.runner.device_bytes()
        assert sum(now[k] for k in traded) <= budget
        if engine.elastic.state is DraftState.OFFLOADED:
            assert now["draft_params"] == now["draft_kv"] == 0
            extension = now["target_kv"] - start["target_kv"]
            assert extension > 0
            # everything live on the device grew by far less than the extension: the draft's
            # buffers were freed, not merely dropped by the runner (what remains is the step's
            # own small outputs, a few KB)
            assert _device_bytes_live() - live0 < extension / 4
            seen.append(True)

    engine.add_step_listener(check)
    _drive(engine, _burst(seed=1), SamplingParams(max_tokens=30, temperature=0.0,
                                                  ignore_eos=True))
    assert engine.metrics.num_pool_expansions >= 1 and seen
    assert engine.runner.device_bytes()["target_kv"] == start["target_kv"]  # extension dropped
