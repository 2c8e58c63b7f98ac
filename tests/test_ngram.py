"""Drafting without a model: prompt lookup (``speculative_method="ngram"``) and suffix decoding
(``"suffix"``): the lookups themselves, the one-hot rejection rule for drafts without a
distribution, and the engine drafting with them losslessly."""

from __future__ import annotations

import gc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import ENGINE_KW, ENGINE_VOCAB, make_engine, run_to_completion
from test_sampling import _exact_two_token_marginals, _sampling_tensors, chi2_rejects
from jspec.proposers import SuffixTree, ngram_lookup
from jspec.proposers.suffix import sequence_draft
from jspec.runner import LoadedModel
from jspec.sampler import processed_logprobs, rejection_sample
from jspec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
CYCLE = 6  # the repeating target's greedy output cycles through groups of this many tokens


def _brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The definition: for n from n_max down to n_min, the latest start s < len - n whose n
    tokens equal the last n; what follows it, up to k tokens."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        for s in range(length - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
       n_min=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(0, 6))
def test_lookup_matches_its_definition(tokens, n_min, extra, k):
    got = ngram_lookup(np.array(tokens, np.int32), n_min, n_min + extra, k)
    want = _brute_force(tokens, n_min, n_min + extra, k) if k else []
    assert got.tolist() == want


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), n_max=st.integers(1, 30))
def test_lookup_from_the_occurrence_index_equals_the_scan(tokens, n_max):
    from jspec.proposers.ngram import longest_earlier_suffix

    t = np.array(tokens, np.int32)
    index = np.array([i for i, x in enumerate(tokens[:-1]) if x == tokens[-1]], np.int64)
    m1, e1 = longest_earlier_suffix(t, n_max)
    m2, e2 = longest_earlier_suffix(t, n_max, index)
    assert m1 == m2 and e1.tolist() == e2.tolist()


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       bounds=st.lists(st.integers(1, 12), min_size=1, max_size=4), bound=st.integers(0, 12),
       steps=st.lists(st.integers(1, 5), min_size=1, max_size=8),
       limit=st.sampled_from([0, 6, 256]))
@example(tokens=[0, 1, 2, 3, 5, 0, 1, 2, 3], bounds=[5, 2], bound=0, steps=[4], limit=256)
def test_one_match_per_row_serves_every_lookup_bound(tokens, bounds, bound, steps, limit):
    """The engine's lookups share each row's match (computed once per length, up to the
    longest any of them takes, and brought up to date a token at a time where the added
    tokens occur less than ``limit`` times before, else scanned anew): whatever bounds they
    ask in whatever order (rotated each step), and as the sequence grows by steps of several
    tokens, each gets ``longest_earlier_suffix`` at its own bound."""
    from jspec.proposers import TokenBuffers
    from jspec.proposers import ngram
    from jspec.proposers.ngram import longest_earlier_suffix
    from jspec.sequence import Sequence

    buffers, s = TokenBuffers(4, bound), Sequence("a", tokens[:1], None, 0)
    rest, k = tokens[1:], 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ngram, "_ADVANCE_LIMIT", limit)
        while rest:
            step = steps[k % len(steps)]
            s.output_token_ids.extend(rest[:step])
            rest, k = rest[step:], k + 1
            for n_max in bounds[k % len(bounds):] + bounds[:k % len(bounds)]:
                got_tokens, (m, ends) = buffers.lookup_input(s, n_max)
                want_m, want_ends = longest_earlier_suffix(np.array(s.token_ids(), np.int32),
                                                           n_max)
                assert got_tokens.tolist() == s.token_ids()
                assert m == want_m and ends.tolist() == want_ends.tolist()


@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=150))
def test_the_most_frequent_token_is_the_smallest_on_a_tie(tokens):
    from jspec.proposers.suffix import _most_frequent

    top = max(tokens.count(t) for t in tokens)
    assert _most_frequent(np.array(tokens, np.int32)) == (
        min(t for t in tokens if tokens.count(t) == top), top)


def test_lookup_prefers_the_longest_suffix_then_the_latest_occurrence():
    t = np.array([1, 2, 3, 9, 7, 3, 8, 5, 2, 3], np.int32)
    # "2 3" occurred at 1-2 (followed by 9); "3" alone most recently at 5 (followed by 8)
    assert ngram_lookup(t, 1, 3, 2).tolist() == [9, 7]
    assert ngram_lookup(t, 1, 1, 2).tolist() == [8, 5]
    # a repeating tail drafts its own continuation, running into the sequence's end
    t = np.array([4, 5, 6, 4, 5, 6, 4, 5], np.int32)
    assert ngram_lookup(t, 2, 2, 5).tolist() == [6, 4, 5]
    assert ngram_lookup(np.array([1, 2, 3], np.int32), 1, 4, 3).tolist() == []


def _substring_counts(seqs, depth):
    counts = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                key = tuple(seq[i:j])
                counts[key] = counts.get(key, 0) + 1
    return counts


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1,
                     max_size=3),
       cut=st.integers(0, 30), depth=st.integers(2, 6), k=st.integers(1, 5),
       factor=st.sampled_from([0.5, 1.0, 2.0]), pmin=st.sampled_from([0.0, 0.3, 0.6]))
def test_suffix_tree_counts_and_drafts_by_their_definition(seqs, cut, depth, k, factor, pmin):
    tree = SuffixTree(depth)
    for seq in seqs:  # the last one in two parts, as a growing request's tree is fed
        tree.add(seq[:cut])
        tree.add(seq, min(cut, len(seq)))
    counts = _substring_counts(seqs, depth)

    assert all(tree.count(key) == c for key, c in counts.items())
    assert tree.num_nodes == 1 + len(counts)  # no node but the root and the counted paths
    query = seqs[-1]
    draft, probs = tree.draft(query, k, factor, pmin)
    # the match: the longest suffix of at most depth - k tokens that has a continuation
    m = next((m for m in range(min(max(depth - k, 1), len(query)), 0, -1)
              if any(key[:-1] == tuple(query[-m:]) for key in counts)), 0)
    path, prob, want_probs = tuple(query[-m:]), 1.0, []
    for tok in draft:  # each drafted token is a most frequent continuation, above pmin
        kids = {key[-1]: c for key, c in counts.items() if key[:-1] == path}
        assert kids[tok] == max(kids.values())
        prob *= kids[tok] / sum(kids.values())
        assert prob >= pmin
        want_probs.append(prob)
        path += (tok,)
    assert probs == pytest.approx(want_probs)
    if m:  # it stops at its length limit, at the trie's end, or below pmin
        kids = {key[-1]: c for key, c in counts.items() if key[:-1] == path}
        assert (len(draft) == min(k, int(factor * m)) or not kids
                or prob * max(kids.values()) / sum(kids.values()) < pmin)
    else:
        assert draft == [] and probs == []
    for seq in seqs:
        tree.remove(seq)
    assert tree.num_nodes == 1 and not tree._edge


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=2,
                     max_size=5),
       order=st.randoms(use_true_random=False), depth=st.integers(2, 6), k=st.integers(1, 5))
def test_a_suffix_tree_after_evictions_is_the_tree_of_what_remains(seqs, order, depth, k):
    """The global tree adds and evicts outputs in any order (reusing the nodes that evictions
    free, its most-frequent-child caches going stale): it counts and drafts as a tree built
    afresh over the outputs it still holds."""
    tree, held = SuffixTree(depth), []
    for seq in seqs:
        tree.add(seq)
        held.append(seq)
        query = seqs[order.randrange(len(seqs))]
        tree.draft(query, k, 2.0, 0.0)  # fills the caches an eviction must invalidate
        if order.random() < 0.5:
            tree.remove(held.pop(order.randrange(len(held))))
    fresh = SuffixTree(depth)
    for seq in held:
        fresh.add(seq)
    # a full garbage collection walks a fixed handful of containers whose contents it does
    # not track, however large the tree grows
    assert not any(gc.is_tracked(x) for v in vars(tree).values() for x in gc.get_referents(v)
                   if not isinstance(x, type))
    assert tree.num_nodes == fresh.num_nodes
    assert all(tree.count(key) == c for key, c in _substring_counts(held, depth).items())
    for query in seqs:
        assert tree.draft(query, k, 2.0, 0.0) == fresh.draft(query, k, 2.0, 0.0)


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=40), depth=st.integers(2, 8),
       k=st.integers(1, 5), factor=st.sampled_from([0.5, 1.0, 2.0]),
       pmin=st.sampled_from([0.0, 0.3, 0.6]))
def test_a_requests_own_draft_is_its_suffix_trees(seq, depth, k, factor, pmin):
    """``sequence_draft`` (from the token array) drafts what a suffix tree over the sequence
    alone drafts."""
    tree = SuffixTree(depth)
    tree.add(seq)
    draft, probs = sequence_draft(np.array(seq, np.int32), depth, k, factor, pmin)
    want, want_probs = tree.draft(seq, k, factor, pmin)
    assert draft == want and probs == pytest.approx(want_probs)
    assert len(probs) == len(draft) and all(np.diff(probs) <= 1e-12)  # chained: never rising


def test_suffix_global_tree_holds_finished_outputs_and_evicts_the_oldest():
    from jspec.proposers import SuffixProposer
    from jspec.sequence import Sequence, SequenceStatus

    def seq(rid, prompt, output=()):
        s = Sequence(rid, list(prompt), None, 0)
        s.output_token_ids = list(output)
        return s

    # (after_dispatch registers each step's sequences; here they are set directly)
    prop = SuffixProposer(max_depth=8, max_spec_factor=2.0, min_token_prob=0.1,
                          max_cached_requests=1, max_num_seqs=4)
    first = seq("a", [1, 2], [7, 8, 9, 10, 11])
    prop._running[id(first)] = first
    fresh = seq("b", [5, 6, 7, 8])  # its own tokens never continue "7 8"
    assert prop.draft(fresh, 3) == []  # a is still running: not in the global tree
    first.status = SequenceStatus.FINISHED_STOPPED
    prop._retire_finished()
    assert prop.draft(fresh, 3) == [9, 10, 11]  # from a's output
    second = seq("c", [3], [20, 21, 22])
    second.status = SequenceStatus.FINISHED_LENGTH
    prop._running[id(second)] = second
    prop._retire_finished()  # one cached request at most: a's output goes
    assert prop.draft(fresh, 3) == [] and prop.draft(seq("d", [20, 21]), 2) == [22]
    assert prop.reset_cache() == 1  # c's output forgotten
    assert prop.draft(seq("d", [20, 21]), 2) == [] and prop.global_tree.num_nodes == 1
    third = seq("e", [4], [30, 31, 32])  # a request running through the reset joins later
    prop._running[id(third)] = third
    third.status = SequenceStatus.FINISHED_LENGTH
    prop._retire_finished()
    assert prop.draft(seq("f", [30, 31]), 2) == [32]


@pytest.mark.parametrize("policy,method", [("static", "suffix"), ("auto", "ngram+suffix")])
def test_every_finished_output_joins_the_global_suffix_tree_before_the_next_draft(
        repeating_target, policy, method):
    """A request's output joins suffix decoding's global tree once the request ends, whichever
    drafter served its rows: in the next step, while its verification runs (a prefill-only
    step here, in which nothing drafts)."""
    from jspec.config import EngineConfig
    from jspec.engine import LLMEngine

    engine = LLMEngine(repeating_target, None,
                       EngineConfig(**dict(ENGINE_KW, speculative_method=method, policy=policy)))
    outs = run_to_completion(engine, _prompts(), GREEDY)
    suffix = next(p for p in engine.planner.spec.proposers.values() if p.name == "suffix")
    records = []
    engine.add_step_listener(records.append)
    # the same request ids again, one token each: prefill steps only
    run_to_completion(engine, [[40, 41, 42]] * 3, SamplingParams(max_tokens=1))
    assert records and not any(r.gamma_bucket for r in records)
    for i, out in outs.items():
        assert suffix.global_tree.count(out.token_ids[:4]) >= 1, f"request {i}"
    assert suffix.global_tree.count([40, 41, 42]) == 0  # their requests are not over yet
    # the engine forgets them, as a benchmark forgets its warm-up requests
    assert engine.reset_suffix_cache() == len(outs)
    assert all(suffix.global_tree.count(out.token_ids[:4]) == 0 for out in outs.values())


def test_survey_skips_a_token_still_on_device_and_keeps_drafts_for_the_step():
    """A policy's survey (what a lookup would draft, before the plan) may see a sequence whose
    newest token is still on device (asynchronous scheduling): the lookup judges it by the
    tokens before, never copies the placeholder into its buffer, and keeps no draft for it."""
    from jspec.proposers import NgramProposer
    from jspec.sequence import PENDING_TOKEN, Sequence

    s = Sequence("a", [5, 6, 7, 5, 6], None, 0)
    s.output_token_ids = [7, PENDING_TOKEN]
    prop = NgramProposer(1, 3, 4)
    # "5 6 7" -> drafts what followed "7": 5 6 7
    assert prop.survey([s], 4).lengths.tolist() == [3]
    assert "a" not in prop._surveyed
    s.output_token_ids[-1] = 5  # the commit: the real token replaces the placeholder
    entry = prop.tokens.entry(s)
    assert entry.buf[:entry.size].tolist() == [5, 6, 7, 5, 6, 7, 5]
    assert entry.earlier().tolist() == [0, 3]
    s.output_token_ids += [9, 6]  # the index follows the new tokens
    entry = prop.tokens.entry(s)
    assert entry.earlier().tolist() == [1, 4] and entry.buf[[1, 4]].tolist() == [6, 6]
    s.output_token_ids[-2:] = []
    assert prop.survey([s], 4).lengths.tolist() == [3] and "a" in prop._surveyed  # "6 7 5"
    assert prop._draft_of(s, 2).tolist() == [6, 7]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 8, 0.95)])
@pytest.mark.parametrize("gamma", [1, 3])
def test_one_hot_rule_keeps_the_target_distribution(temperature, top_k, top_p, gamma):
    """Drafts with no distribution (draft_logits None): x is accepted with probability p(x),
    else the token comes from p without x. Whatever the drafted tokens, the first emitted token
    follows p; a 2% shift is detected."""
    vocab, rows = 12, 40_000
    rng = np.random.default_rng(10 + gamma)
    p_logits = rng.normal(0, 1.0, (gamma + 1, vocab)).astype(np.float32)
    st_ = _sampling_tensors(rows, temperature, top_k, top_p)
    p_proc = np.exp(np.asarray(processed_logprobs(jnp.asarray(p_logits)[None], st_)[0]))
    # drafts from an arbitrary distribution unrelated to p: a lookup's tokens
    draft_tokens = rng.choice(vocab, (rows, gamma), p=np.linspace(1, 3, vocab) / 24)
    result = jax.jit(rejection_sample)(
        jnp.broadcast_to(p_logits, (rows, gamma + 1, vocab)), None,
        jnp.asarray(draft_tokens, jnp.int32), jnp.full((rows,), gamma, jnp.int32), st_)
    first = np.asarray(result.tokens[:, 0])
    target = p_proc[0] / p_proc[0].sum()
    counts = np.bincount(first, minlength=vocab)
    assert not chi2_rejects(counts, target)
    accepted = np.asarray(result.num_accepted)
    assert 0.02 < (accepted > 0).mean() < 0.98  # both paths run
    # a rejected token is never the one drawn in its place
    rejected = accepted == 0
    assert not (first[rejected] == draft_tokens[rejected, 0]).any()
    shifted = target.copy()
    top = np.argsort(target)[::-1]
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert chi2_rejects(counts, shifted)


@pytest.fixture(scope="module")
def repeating_target(engine_models):
    """The tiny target made to repeat itself, as input-grounded text does: its layers write
    little into the residual stream, and its head maps each token to the next one of a cycle of
    CYCLE tokens, so greedy output cycles and a lookup drafts it (its sampled output mostly
    follows the cycle too; acceptance is high but not 1)."""
    target, _, _ = engine_models
    params = jax.tree_util.tree_map(np.asarray, target.params)
    layers = dict(params["layers"])
    layers["wo"] = layers["wo"] * 0.05
    layers["w_down"] = layers["w_down"] * 0.05
    embed = params["embed"]
    nxt = np.arange(ENGINE_VOCAB)
    nxt = nxt - nxt % CYCLE + (nxt % CYCLE + 1) % CYCLE  # next token in its group of CYCLE
    nxt = np.minimum(nxt, ENGINE_VOCAB - 1)
    head = np.zeros_like(params["lm_head"])
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    np.add.at(head.T, nxt, unit)
    head += 0.1 * np.random.default_rng(3).standard_normal(head.shape).astype(head.dtype)
    params = dict(params, layers=layers, lm_head=head)
    return LoadedModel(target.cfg, jax.tree_util.tree_map(jnp.asarray, params), "repeating")


def _prompts():
    rng = np.random.default_rng(11)
    out = [rng.integers(3, ENGINE_VOCAB, n).tolist() for n in (3, 9, 17, 30, 64, 5, 12, 48)]
    out[1] = [12, 13, 14, 15, 16, 17] * 3  # a prompt that already cycles
    return out


@pytest.fixture(scope="module")
def repeating_reference(repeating_target):
    engine = make_engine(repeating_target, None)
    outs = run_to_completion(engine, _prompts(), GREEDY)
    return [outs[str(i)].token_ids for i in range(len(outs))]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("overrides", [
    {},  # asynchronous scheduling and prefix caching on (the defaults)
    {"async_scheduling": False, "enable_prefix_caching": False, "prompt_lookup_min": 1,
     "suffix_decoding_max_tree_depth": 8},
    {"num_kv_blocks": 14},  # too few blocks for every sequence: preemption and recompute
], ids=["defaults", "sync-no-cache", "preemption"])
def test_greedy_lookup_equals_target_only(repeating_target, repeating_reference, overrides,
                                          method):
    engine = make_engine(repeating_target, None, speculative_method=method, **overrides)
    compiled = engine.runner.num_compiled  # after the warm-up
    records = []
    engine.add_step_listener(records.append)
    outs = run_to_completion(engine, _prompts(), GREEDY)
    for i, ref in enumerate(repeating_reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    # some decode steps verified only the tokens the lookups found, narrower than rows x (1 + γ)
    rc = engine.rc
    assert any(r.gamma_bucket and not r.num_prefill_tokens and r.num_padded_tokens
               < rc.seq_bucket(r.num_decode) * (1 + r.gamma_bucket) for r in records)
    m = engine.metrics
    assert m.spec_decode_num_accepted_tokens > 0.25 * m.spec_decode_num_draft_tokens > 0
    if "num_kv_blocks" in overrides:
        assert m.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
    assert engine.runner.num_compiled == compiled  # the warm-up compiled every shape it ran


def assert_first_two_tokens_follow_the_target(engine, target, n: int = 1600) -> None:
    """Through ``engine``: the first token (prefill) and the second (a decode step in which a
    lookup drafts the cycle's next token) of ``n`` seeded samples follow ``target``'s exact
    marginals."""
    prompt = [30, 31, 32, 33, 34, 35, 30, 31]
    temperature = 1.0
    p1, p2 = _exact_two_token_marginals(target, prompt, temperature)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(n)]
    outs = run_to_completion(engine, [prompt] * n, params)
    tokens = np.array([outs[str(i)].token_ids for i in range(n)])
    assert not chi2_rejects(np.bincount(tokens[:, 0], minlength=p1.size), p1)
    assert not chi2_rejects(np.bincount(tokens[:, 1], minlength=p2.size), p2)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampling_with_lookup_drafts_keeps_the_target_distribution(repeating_target, method):
    engine = make_engine(repeating_target, None, speculative_method=method,
                         prompt_lookup_min=1)
    assert_first_two_tokens_follow_the_target(engine, repeating_target)
    m = engine.metrics
    assert 0 < m.spec_decode_num_accepted_tokens < m.spec_decode_num_draft_tokens


def test_seeded_sampling_with_lookup_is_reproducible(repeating_target):
    sp = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=50 + i,
                         ignore_eos=True) for i in range(6)]
    prompts = _prompts()[:6]
    runs = [run_to_completion(make_engine(repeating_target, None, speculative_method="ngram"),
                              prompts, sp) for _ in range(2)]
    assert [runs[0][str(i)].token_ids for i in range(6)] == \
        [runs[1][str(i)].token_ids for i in range(6)]


def test_lookup_configuration_errors(engine_models):
    from jspec.config import EngineConfig
    from jspec.policies import make_policy

    target, draft, _ = engine_models
    with pytest.raises(ValueError, match="'ngram' drafts without a draft model, but 1 draft"):
        make_engine(target, draft, speculative_method="ngram")
    with pytest.raises(ValueError, match="policy 'dsde' needs the draft distribution's signals"):
        make_engine(target, None, make_policy("dsde", 7), speculative_method="ngram")
    with pytest.raises(ValueError, match="policy 'dsd' needs a draft model's step-time profile"):
        make_engine(target, None, make_policy("dsd", 7), speculative_method="ngram")
    with pytest.raises(ValueError, match="elastic_memory offloads the draft model; it does not "
                                         "run beside a drafter without one"):
        make_engine(target, draft, speculative_method="draft_model+ngram", elastic_memory=True)
    with pytest.raises(ValueError, match="names 'draft_model', but no draft model was given"):
        make_engine(target, None, speculative_method="draft_model+suffix")
    with pytest.raises(ValueError, match="'ngram\\+ngram' names a drafter twice"):
        EngineConfig(speculative_method="ngram+ngram")
    with pytest.raises(ValueError, match="1 <= prompt_lookup_min <= prompt_lookup_max, got 3 "
                                         "and 2"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_method names 'suffix-tree'; each drafter "
                                         "must be one of"):
        EngineConfig(speculative_method="suffix-tree")
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob must be in"):
        EngineConfig(suffix_decoding_min_token_prob=1.5)
    with pytest.raises(ValueError, match="'suffix' drafts without a draft model"):
        make_engine(target, draft, speculative_method="suffix")


def test_a_decode_step_verifies_at_a_token_bucket_only_where_that_costs_less():
    from jspec.config import EngineConfig, resolve

    rc = resolve(EngineConfig(max_num_seqs=16, num_speculative_tokens=4,
                              max_num_batched_tokens=256, min_token_bucket=8), 1024, 1024)
    assert rc.seq_buckets[-1] == 16 and 32 in rc.token_buckets and 64 in rc.token_buckets
    # 16 rows at γ = 4 are 80 tokens fused; lookups that found 2 tokens a row verify 48 -> 64
    assert rc.ragged_verify_pays(48, 16, 4, head_share=0.2)
    assert not rc.ragged_verify_pays(80, 16, 4, head_share=0.2)  # 128 > 80
    # 2 rows: the widest bucket's 16 logits rows cost more than the 2 tokens saved
    assert not rc.ragged_verify_pays(6, 2, 4, head_share=0.2)
    # without an LM head to pay for, any narrower bucket pays
    assert rc.ragged_verify_pays(6, 2, 4, head_share=0.0)
    # one sequence at a time: no step with prefill beside a drafting row is compiled
    one = resolve(EngineConfig(max_num_seqs=1, num_speculative_tokens=4), 1024, 1024)
    assert not one.ragged_verify_pays(1, 1, 4, head_share=0.0)
