"""Scheduler: FCFS continuous batching, chunked prefill, lookahead slots, recompute preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_helpers import make_view

from jspec.block_manager import BlockManager
from jspec.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from jspec.sequence import Sequence, SequenceStatus

_arrivals = iter(range(10**9))


def make_seq(request_id: str, prompt_len: int, num_outputs: int = 0) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(range(prompt_len)),
                    sampling_params=None, arrival_index=next(_arrivals),
                    output_token_ids=[7] * num_outputs)


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
         max_model_len=256, lookahead_slots=0, chunked=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, lookahead_slots=lookahead_slots,
                             enable_chunked_prefill=chunked)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(config, bm), bm


def commit(sched: Scheduler, out: SchedulerOutput, accepted: dict[str, int] | None = None):
    """What the engine does after a step: advance num_computed, append sampled tokens, roll back."""
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed += item.num_new_tokens
        if item.samples:
            extra = (accepted or {}).get(seq.request_id, 0)
            assert extra <= item.num_lookahead_slots
            seq.output_token_ids.extend([1] * (1 + extra))
            seq.num_computed = seq.num_tokens - 1
            sched.block_manager.truncate(seq.request_id, seq.num_tokens)
    sched.check_invariants()


def by_id(out: SchedulerOutput) -> dict[str, ScheduledSeq]:
    return {item.seq.request_id: item for item in out.scheduled}


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(lookahead_slots=-1), "lookahead_slots"),
    (dict(max_num_seqs=16, max_num_batched_tokens=8), ">= max_num_seqs"),
    (dict(max_num_seqs=2, max_num_batched_tokens=4, lookahead_slots=4), "1 \\+ lookahead"),
    (dict(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False),
     "without chunked prefill"),
])
def test_config_validation(kwargs, message):
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, lookahead_slots=0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**base)


def test_config_is_frozen():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8)
    with pytest.raises(Exception):
        config.max_num_seqs = 2  # type: ignore[misc]


# ---------------------------------------------------------------- queues


def test_add_queues_and_rejects_duplicates_and_empty():
    sched, _ = make()
    seq = make_seq("a", 4)
    sched.add(seq)
    assert seq.status is SequenceStatus.WAITING
    assert sched.num_waiting == 1 and sched.num_running == 0 and sched.has_unfinished()
    with pytest.raises(ValueError, match="'a'"):
        sched.add(make_seq("a", 4))
    with pytest.raises(ValueError, match="no tokens"):
        sched.add(make_seq("empty", 0))


def test_empty_scheduler_schedules_nothing():
    sched, _ = make()
    out = sched.schedule()
    assert not out.scheduled and out.preempted == [] and out.num_batched_tokens == 0
    assert not sched.has_unfinished()


def test_fcfs_admission_and_views():
    sched, _ = make()
    seqs = [make_seq(f"r{i}", 3) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    assert list(sched.waiting) == seqs
    out = sched.schedule()
    assert [item.seq for item in out.scheduled] == seqs
    assert all(item.num_new_tokens == 3 and item.samples and not item.is_decode
               for item in out.scheduled)
    assert list(sched.running) == seqs and sched.num_waiting == 0
    assert all(seq.status is SequenceStatus.RUNNING for seq in seqs)
    assert out.num_batched_tokens == 12
    sched.check_invariants()


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 2))
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["r0", "r1"]
    commit(sched, out)
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["r0", "r1"]
    commit(sched, out)
    sched.finish(sched.running[0], SequenceStatus.FINISHED_STOPPED)  # r0
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["r1", "r2"]


def test_running_sequences_come_first_then_waiting():
    sched, _ = make(max_num_batched_tokens=16)
    sched.add(make_seq("old", 4))
    commit(sched, sched.schedule())
    sched.add(make_seq("new", 30))
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens, i.is_decode) for i in out.scheduled] == [
        ("old", 1, True), ("new", 15, False)]
    assert out.num_batched_tokens == 16


def test_decode_reserves_lookahead_budget_and_slots():
    sched, bm = make(block_size=4, max_num_batched_tokens=16, lookahead_slots=5)
    seq = make_seq("a", 6)
    sched.add(seq)
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_slots == 0  # prefill: no lookahead
    commit(sched, out)  # 7 tokens, 6 computed
    out = sched.schedule()
    item = out.scheduled[0]
    assert item.is_decode and item.samples and item.num_new_tokens == 1
    assert item.num_lookahead_slots == 5
    assert out.num_batched_tokens == 6
    assert bm.num_slots("a") >= 7 + 5
    commit(sched, out, accepted={"a": 3})
    assert seq.num_tokens == 11 and bm.num_slots("a") == 12


def test_token_budget_limits_admission_and_shrinks_lookahead():
    # budget 8, lookahead 3: two decodes take 4 + 4; a third request must wait for budget
    sched, _ = make(max_num_seqs=4, max_num_batched_tokens=8, lookahead_slots=3)
    sched.add(make_seq("a", 1))  # a 1-token prompt is already a decode
    sched.add(make_seq("b", 1))
    sched.add(make_seq("c", 1))
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_lookahead_slots) for i in out.scheduled] == [
        ("a", 3), ("b", 3)]
    assert out.num_batched_tokens == 8
    assert sched.num_waiting == 1


def test_lookahead_shrinks_so_every_running_sequence_gets_a_token():
    sched, _ = make(max_num_seqs=3, max_num_batched_tokens=6, lookahead_slots=5)
    for rid in "abc":
        sched.add(make_seq(rid, 2))
    commit(sched, sched.schedule())
    out = sched.schedule()
    # a keeps one budget token for each of b and c
    assert [(i.seq.request_id, i.num_lookahead_slots) for i in out.scheduled] == [
        ("a", 3), ("b", 0), ("c", 0)]
    assert out.num_batched_tokens == 6


def test_lookahead_capped_at_max_model_len():
    sched, bm = make(block_size=4, max_model_len=10, lookahead_slots=4)
    sched.add(make_seq("a", 8))
    commit(sched, sched.schedule())  # 9 tokens
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_slots == 1
    assert bm.num_slots("a") == 12  # 10 slots need 3 blocks
    assert out.num_batched_tokens == 2
    commit(sched, out)  # 10 tokens: the engine would stop it now; scheduling it anyway is safe
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_slots == 0


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_exact_chunks():
    sched, bm = make(block_size=4, max_num_batched_tokens=8)
    seq = make_seq("a", 20)
    sched.add(seq)
    sizes = []
    for _ in range(3):
        out = sched.schedule()
        (item,) = out.scheduled
        sizes.append((item.num_new_tokens, item.samples, item.is_decode))
        assert bm.num_slots("a") >= seq.num_computed + item.num_new_tokens
        commit(sched, out)
    assert sizes == [(8, False, False), (8, False, False), (4, True, False)]
    assert seq.num_output_tokens == 1 and seq.num_computed == 20
    out = sched.schedule()
    assert out.scheduled[0].is_decode


def test_chunk_takes_only_the_remaining_budget():
    sched, _ = make(max_num_batched_tokens=10)
    sched.add(make_seq("a", 6))
    sched.add(make_seq("b", 9))
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [
        ("a", 6, True), ("b", 4, False)]
    commit(sched, out)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [
        ("a", 1, True), ("b", 5, True)]


def test_without_chunking_a_prompt_waits_until_it_fits():
    sched, _ = make(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16, chunked=False)
    sched.add(make_seq("a", 10))
    sched.add(make_seq("b", 8))
    sched.add(make_seq("c", 2))
    out = sched.schedule()
    # b does not fit in the 6 tokens left and blocks c behind it (strict FCFS)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 10)]
    commit(sched, out)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("a", 1), ("b", 8), ("c", 2)]


# ---------------------------------------------------------------- memory


def test_waiting_head_that_does_not_fit_blocks_the_queue():
    sched, _ = make(num_blocks=5, block_size=4)  # 16 slots
    sched.add(make_seq("a", 12))
    sched.add(make_seq("big", 8))
    sched.add(make_seq("small", 2))
    out = sched.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_nothing_fits_and_nothing_runs_returns_empty_output():
    sched, _ = make(num_blocks=3, block_size=4)  # 8 slots; the engine would have refused this
    sched.add(make_seq("huge", 20))
    sched.add(make_seq("small", 2))
    for _ in range(3):
        out = sched.schedule()
        assert not out.scheduled and out.preempted == []
    assert sched.num_waiting == 2


def test_lookahead_shrinks_before_anything_is_preempted():
    sched, bm = make(num_blocks=5, block_size=4, lookahead_slots=4)  # 16 slots
    sched.add(make_seq("a", 7))
    sched.add(make_seq("b", 7))
    commit(sched, sched.schedule())  # each holds 8 tokens in 2 blocks; pool full
    assert bm.num_free_blocks == 0
    out = sched.schedule()
    # both still fit their next token in their own blocks: no lookahead, no preemption
    assert [(i.seq.request_id, i.num_lookahead_slots) for i in out.scheduled] == [
        ("a", 0), ("b", 0)]
    assert out.preempted == []


def test_preempts_youngest_when_blocks_run_out_and_resumes_it_later():
    sched, bm = make(num_blocks=5, block_size=4)  # 4 usable blocks = 16 slots
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    commit(sched, sched.schedule())  # 2 blocks each, pool full; now 9 tokens each
    late = make_seq("late", 3)
    sched.add(late)
    out = sched.schedule()  # a needs a 3rd block for token 9: b (youngest) is preempted
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0
    assert b.num_preemptions == 1 and b.num_output_tokens == 1
    assert not bm.has("b")
    assert [s.request_id for s in sched.waiting] == ["b", "late"]  # front of the queue
    sched.check_invariants()
    commit(sched, out)  # a: 10 tokens
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert bm.num_free_blocks == 4
    out = sched.schedule()
    items = by_id(out)
    # b is prefilled again from scratch, prompt and its output token
    assert items["b"].num_new_tokens == 9 and items["b"].samples
    assert items["late"].num_new_tokens == 3
    assert [i.seq.request_id for i in out.scheduled] == ["b", "late"]
    commit(sched, out)
    assert b.num_output_tokens == 2 and b.num_computed == 9


def test_no_admission_in_a_step_that_preempted():
    sched, _ = make(num_blocks=5, block_size=4)
    sched.add(make_seq("a", 8))
    sched.add(make_seq("b", 8))
    commit(sched, sched.schedule())
    sched.add(make_seq("tiny", 1))
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["b"]
    assert "tiny" not in by_id(out)


def test_preempts_several_youngest_in_order():
    sched, _ = make(num_blocks=7, block_size=4, max_num_batched_tokens=64)  # 24 slots
    a = make_seq("a", 15)
    sched.add(a)
    sched.add(make_seq("b", 3))
    sched.add(make_seq("c", 3))
    commit(sched, sched.schedule())  # a: 16 tokens in 4 blocks, b and c: 1 block each
    # a grows to 24 tokens: needs 2 more blocks, only 0 free
    a.output_token_ids.extend([1] * 8)
    a.num_computed = 23
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["c", "b"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    sched.check_invariants()


def test_sequence_preempts_itself_when_it_is_the_youngest():
    sched, bm = make(num_blocks=5, block_size=4)  # 16 slots
    sched.add(make_seq("a", 11))
    b = make_seq("b", 3)
    sched.add(b)
    commit(sched, sched.schedule())  # a: 12 tokens in 3 blocks, b: 4 tokens in 1 block
    b.output_token_ids.append(1)  # b needs slot 5: a second block
    b.num_computed = 4
    out = sched.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert [s.request_id for s in out.preempted] == ["b"]
    sched.check_invariants()


def test_lone_sequence_larger_than_the_pool_does_not_spin():
    sched, bm = make(num_blocks=3, block_size=4, max_num_batched_tokens=8)  # 8 slots
    seq = make_seq("a", 8)
    sched.add(seq)
    commit(sched, sched.schedule())  # 9 tokens: the engine would have rejected this request
    out = sched.schedule()
    assert out.scheduled == [] and out.preempted == [seq]
    assert not bm.has("a") and bm.num_free_blocks == 2


def test_running_prefill_chunk_shrinks_to_free_memory():
    sched, bm = make(num_blocks=5, block_size=4, max_num_batched_tokens=8)  # 16 slots
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 12))
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 4), ("b", 4)]
    commit(sched, out)
    out = sched.schedule()
    # a's decode takes a 2nd block; b's budget allows 7 tokens but one free block holds only 4
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 4)]
    assert out.preempted == [] and bm.num_free_blocks == 0
    commit(sched, out)


# ---------------------------------------------------------------- abort / finish


def test_abort_from_waiting_and_running_frees_blocks():
    sched, bm = make()
    sched.add(make_seq("run", 9))
    commit(sched, sched.schedule())
    sched.add(make_seq("wait", 4))
    assert bm.num_used_blocks == 3
    seq = sched.abort("wait")
    assert seq.status is SequenceStatus.FINISHED_ABORTED and sched.num_waiting == 0
    seq = sched.abort("run")
    assert seq.status is SequenceStatus.FINISHED_ABORTED and sched.num_running == 0
    assert bm.num_used_blocks == 0 and not bm.has("run")
    assert sched.abort("run") is None and sched.abort("never") is None
    assert not sched.has_unfinished()
    sched.check_invariants()


def test_finish_frees_blocks_and_sets_status():
    sched, bm = make()
    seq = make_seq("a", 5)
    sched.add(seq)
    commit(sched, sched.schedule())
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert bm.num_used_blocks == 0 and sched.num_running == 0 and not sched.has_unfinished()


def test_finish_errors_and_finish_after_abort_is_a_noop():
    sched, _ = make()
    seq = make_seq("a", 5)
    sched.add(seq)
    sched.schedule()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish(seq, SequenceStatus.RUNNING)
    with pytest.raises(KeyError, match="stranger"):
        sched.finish(make_seq("stranger", 2), SequenceStatus.FINISHED_STOPPED)
    sched.abort("a")
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert seq.status is SequenceStatus.FINISHED_ABORTED


def test_running_sequence_without_uncomputed_token_is_an_error():
    sched, _ = make()
    seq = make_seq("a", 3)
    sched.add(seq)
    sched.schedule()
    seq.num_computed = 3
    with pytest.raises(RuntimeError, match="no uncomputed token"):
        sched.schedule()


def _four_decoders():
    """Four sequences decoding with lookahead 5 under a 32-token budget."""
    sched, bm = make(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, lookahead_slots=5)
    for rid in "abcd":
        sched.add(make_seq(rid, 3))
    commit(sched, sched.schedule())
    return sched, bm


def test_reclaim_spends_unplanned_lookahead_on_prefill():
    sched, bm = _four_decoders()
    sched.add(make_seq("long", 40))
    sched.add(make_seq("next", 10))
    out = sched.schedule()
    # four decodes reserve 1 + 5 each (24 of 32): the long prompt gets an 8-token chunk
    assert by_id(out)["long"].num_new_tokens == 8 and "next" not in by_id(out)
    # the policy plans γ = 2 for "a" and 0 for the others: 18 tokens go back to the prefill
    assert sched.reclaim(out, [2, 0, 0, 0, 0])
    items = by_id(out)
    assert [items[r].num_lookahead_slots for r in "abcd"] == [2, 0, 0, 0]
    assert items["long"].num_new_tokens == 26 and not items["long"].samples
    assert "next" not in items and out.num_batched_tokens == 32
    assert bm.num_slots("long") >= 26
    commit(sched, out)
    assert not sched.reclaim(sched.schedule(), [5, 5, 5, 5, 0])  # nothing to give back


def test_prefill_backlog_counts_prompts_that_wait_for_budget_not_for_a_slot():
    sched, _ = _four_decoders()  # 8 slots, 4 decoding
    for rid, n in (("long", 40), ("next", 10), ("w1", 11), ("w2", 12), ("w3", 13), ("w4", 14)):
        sched.add(make_seq(rid, n))
    out = sched.schedule()
    assert by_id(out)["long"].num_new_tokens == 8  # 32 - 4 x (1 + 5)
    # long's 32 tokens after this chunk, and the three waiting requests the three free slots
    # could take; w3 and w4 wait for a slot
    assert sched.prefill_backlog(out.scheduled) == (32 + 10 + 11 + 12, 4)
    view = make_view(4, num_prefill_tokens=8, prefill_backlog_tokens=65,
                       prefill_backlog_requests=4)
    assert view.prefill_bound
    commit(sched, out)
    # decoding rows are not backlog, and a running prompt's chunk is taken off it
    assert sched.prefill_backlog([]) == (32 + 10 + 11 + 12, 4)


def test_prefill_bound_needs_a_queue_as_long_as_the_decoding_batch():
    # a transient queue (two requests finished together at saturation) is not prefill-bound
    assert not make_view(30, num_prefill_tokens=256, prefill_backlog_tokens=340,
                           prefill_backlog_requests=2).prefill_bound
    # one long prompt at low load is not either
    assert not make_view(1, num_prefill_tokens=256, prefill_backlog_tokens=4000,
                           prefill_backlog_requests=1).prefill_bound
    # the chunk of this step clears the queue: nothing waits behind it
    assert not make_view(2, num_prefill_tokens=512, prefill_backlog_tokens=300,
                           prefill_backlog_requests=3).prefill_bound
    assert make_view(4, num_prefill_tokens=256, prefill_backlog_tokens=9000,
                       prefill_backlog_requests=6).prefill_bound


def test_reclaim_completes_a_prompt_then_admits_the_next():
    sched, _ = _four_decoders()
    sched.add(make_seq("short", 12))
    sched.add(make_seq("next", 30))
    out = sched.schedule()
    assert sched.reclaim(out, [0] * 5)
    items = by_id(out)
    assert items["short"].num_new_tokens == 12 and items["short"].samples
    assert items["next"].num_new_tokens == 16 and not items["next"].is_decode  # 32 - 4 - 12
    assert out.num_batched_tokens == 32
    commit(sched, out)


def test_reclaim_admits_nothing_after_a_preemption():
    sched, _ = make(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                    lookahead_slots=3)
    sched.add(make_seq("a", 7))
    sched.add(make_seq("b", 7))
    commit(sched, sched.schedule())
    sched.add(make_seq("c", 4))
    out = sched.schedule()
    while not out.preempted:  # grow until the pool runs out
        commit(sched, out)
        out = sched.schedule()
    sched.reclaim(out, [0] * len(out.scheduled))
    assert "c" not in by_id(out)


# ---------------------------------------------------------------- randomized engine loop


def simulate(seed: int, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
             max_model_len: int, lookahead: int, chunked: bool, num_requests: int,
             caching: bool = False):
    """A random workload through the scheduler, committed as the engine commits. Prompts start
    with runs of zeros of random length, so with ``caching`` they share prefixes all the time."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, lookahead_slots=lookahead,
                             enable_chunked_prefill=chunked)
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    sched = Scheduler(config, bm)
    capacity = min(max_model_len, (num_blocks - 1) * block_size)
    assert capacity >= 2
    limits: dict[str, int] = {}
    finished_prompt_tokens = 0  # of the requests that ran to the end (each admitted at least once)
    added = 0
    arrival = 0
    for step in range(20_000):
        if added < num_requests and rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                if added == num_requests:
                    break
                # the engine's admission check: prompt + max_tokens must fit the pool and model
                prompt = rng.randint(1, capacity - 1)
                limits[f"r{added}"] = prompt + rng.randint(1, capacity - prompt)
                shared = rng.randint(0, prompt)
                tokens = [0] * shared + [rng.randint(0, 1) for _ in range(prompt - shared)]
                sched.add(Sequence(request_id=f"r{added}", prompt_token_ids=tokens,
                                   sampling_params=None, arrival_index=arrival))
                added += 1
                arrival += 1
        if rng.random() < 0.05 and sched.has_unfinished():
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            assert sched.abort(victim.request_id) is victim

        out = sched.schedule()
        sched.check_invariants()
        if rng.random() < 0.5:  # the policy plans less than the reservation
            before = [(i.seq.request_id, i.is_decode) for i in out.scheduled]
            kept = [rng.randint(0, i.num_lookahead_slots) for i in out.scheduled]
            sched.reclaim(out, kept)
            sched.check_invariants()
            assert [(i.seq.request_id, i.is_decode) for i in out.scheduled[:len(before)]] == before
            assert [i.num_lookahead_slots for i in out.scheduled[:len(kept)]] == kept
            assert not any(i.is_decode for i in out.scheduled[len(before):])
        assert out.num_batched_tokens <= budget
        assert out.num_batched_tokens == sum(i.num_new_tokens + i.num_lookahead_slots
                                             for i in out.scheduled)
        assert len(out.scheduled) <= max_num_seqs
        if sched.has_unfinished() and not out.preempted:
            assert out.scheduled, "a lone admissible sequence must make progress"
        for item in out.scheduled:
            seq = item.seq
            rid = seq.request_id
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert item.is_decode == (seq.num_uncomputed == 1)
            assert item.samples == (seq.num_computed + item.num_new_tokens == seq.num_tokens)
            if item.num_lookahead_slots:
                assert item.is_decode
                assert seq.num_tokens + item.num_lookahead_slots <= max_model_len
            assert item.num_lookahead_slots <= lookahead
            # every KV slot the step may write is allocated
            assert bm.num_slots(rid) >= (seq.num_computed + item.num_new_tokens
                                         + item.num_lookahead_slots)
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed == 0
            assert not bm.has(seq.request_id)

        # commit, as the engine would
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed += item.num_new_tokens
            if not item.samples:
                bm.cache_blocks(seq.request_id, seq.num_computed, [0], seq.token_ids)
                continue
            accepted = rng.randint(0, item.num_lookahead_slots)
            room = limits[seq.request_id] - seq.num_tokens
            seq.output_token_ids.extend([1] * min(1 + accepted, room))
            seq.num_computed = seq.num_tokens - 1
            bm.cache_blocks(seq.request_id, seq.num_computed, [0], seq.token_ids)
            if seq.num_tokens >= limits[seq.request_id] or rng.random() < 0.02:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished_prompt_tokens += seq.num_prompt_tokens
            else:
                bm.truncate(seq.request_id, seq.num_tokens)
        sched.check_invariants()
        if added == num_requests and not sched.has_unfinished():
            break
    else:
        raise AssertionError("the simulated engine did not finish: livelock")
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.num_used_blocks == 0
    if caching:
        assert finished_prompt_tokens <= bm.stats.queries and bm.stats.hits <= bm.stats.queries
        return bm.stats
    else:
        assert bm.num_cached_blocks == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), num_blocks=st.integers(2, 48),
       block_size=st.sampled_from([1, 2, 4, 16]), max_num_seqs=st.integers(1, 8),
       extra_budget=st.integers(0, 40), max_model_len=st.integers(2, 160),
       lookahead=st.integers(0, 6), chunked=st.booleans(), num_requests=st.integers(1, 40),
       caching=st.booleans())
def test_randomized_engine_loop(seed, num_blocks, block_size, max_num_seqs, extra_budget,
                                max_model_len, lookahead, chunked, num_requests, caching):
    num_blocks = max(num_blocks, 1 + -(-2 // block_size))  # room for a 1-token prompt + 1
    budget = max(max_num_seqs, 1 + lookahead) + extra_budget
    if not chunked:
        budget = max(budget, max_model_len)
    simulate(seed, num_blocks, block_size, max_num_seqs, budget, max_model_len, lookahead,
             chunked, num_requests, caching)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_engine_loop_under_memory_pressure(seed, chunked, caching):
    """Many long sequences in a pool that holds only a few: lots of preemption (and, with
    caching, preempted sharers and evictions)."""
    simulate(seed, num_blocks=9, block_size=4, max_num_seqs=6, budget=32, max_model_len=32,
             lookahead=4, chunked=chunked, num_requests=40, caching=caching)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_engine_loop_wide_batch(seed, caching):
    stats = simulate(seed, num_blocks=200, block_size=8, max_num_seqs=32, budget=256,
                     max_model_len=512, lookahead=5, chunked=True, num_requests=120,
                     caching=caching)
    if caching:  # shared runs of zeros: a good share of the prompts comes from the cache
        assert stats.hits > 0.1 * stats.queries
