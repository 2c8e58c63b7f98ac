"""Asynchronous scheduling (LLMEngine.step): a decode-only γ = 0 step is dispatched before the
host commits the one before it, whose tokens feed it on device. Whatever the timing, the engine
must produce exactly what it produces when every step is committed before the next: same tokens,
same finish reasons, same streamed deltas, the same KV accounting, stops and aborts included."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from conftest import ENGINE_KW, make_engine, run_to_completion
from jspec.sampling_params import SamplingParams
from jspec.sequence import PENDING_TOKEN
from jspec.policies.base import BatchView, DraftPlan, Policy


def _engine(engine_models, async_scheduling: bool, draft=False, **kw):
    target, agreeing, _ = engine_models
    return make_engine(target, agreeing if draft else None, async_scheduling=async_scheduling,
                       **kw)


def _params(n: int, temperature: float = 0.0, stop_token_ids=()):
    """Mixed lengths, so requests finish at different steps while others keep decoding."""
    return [SamplingParams(max_tokens=6 + 5 * (i % 4), temperature=temperature, seed=100 + i,
                           ignore_eos=True, stop_token_ids=list(stop_token_ids))
            for i in range(n)]


def _tokens(outs):
    return {rid: (o.token_ids, o.finish_reason) for rid, o in outs.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_async_equals_sync(engine_models, mixed_prompts, temperature):
    sync = _engine(engine_models, False)
    ref = run_to_completion(sync, mixed_prompts, _params(len(mixed_prompts), temperature))
    assert sync.metrics.num_async_steps == 0
    eng = _engine(engine_models, True)
    got = run_to_completion(eng, mixed_prompts, _params(len(mixed_prompts), temperature))
    assert _tokens(got) == _tokens(ref)
    assert eng.metrics.num_async_steps > 10  # it did overlap
    assert eng.metrics.num_generated_tokens == sync.metrics.num_generated_tokens
    # every block back (prefix caching may keep some cached, but none owned)
    assert eng.block_manager.num_free_blocks == sync.block_manager.num_free_blocks


def test_stop_token_mid_pipeline(engine_models, ten_prompts, greedy_reference):
    """A request that stops on a token finishes at that token, though its next step was already
    running; the others are unaffected."""
    stops = {i: ref[7] for i, ref in enumerate(greedy_reference)}
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             stop_token_ids=[stops[i]]) for i in range(len(ten_prompts))]
    got = run_to_completion(_engine(engine_models, True), ten_prompts, params)
    ref = run_to_completion(_engine(engine_models, False), ten_prompts, params)
    assert _tokens(got) == _tokens(ref)
    for i, ref_tokens in enumerate(greedy_reference):
        out = got[str(i)]
        cut = ref_tokens.index(stops[i]) + 1
        assert out.token_ids == ref_tokens[:cut] and out.finish_reason == "stop"


def test_streamed_deltas_add_up_and_never_show_the_pending_token(engine_models, ten_prompts,
                                                                  greedy_reference):
    eng = _engine(engine_models, True)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(ten_prompts):
        eng.add_request(str(i), prompt, sp)
    deltas: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert PENDING_TOKEN not in out.token_ids
            deltas.setdefault(out.request_id, []).extend(out.delta_token_ids)
            text[out.request_id] = text.get(out.request_id, "") + out.delta_text
            if out.finished:
                assert out.text == text[out.request_id]
        eng.scheduler.check_invariants()
    assert [deltas[str(i)] for i in range(len(ten_prompts))] == greedy_reference
    assert eng.metrics.num_async_steps > 10


def test_abort_and_arrival_while_a_step_is_in_flight(engine_models, mixed_prompts):
    """Aborts and new requests between steps: the in-flight step is committed first, the aborted
    request's slot in it is dropped, and everything else decodes as without overlap."""

    def run(async_scheduling):
        eng = _engine(engine_models, async_scheduling)
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i in range(4):
            eng.add_request(str(i), mixed_prompts[i][:20], sp)
        outs, n = {}, 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out
            n += 1
            if n == 12:
                eng.abort_request("1")
            if n == 15:
                eng.add_request("late", mixed_prompts[5][:9], sp)
            eng.scheduler.check_invariants()
        return eng, outs

    eng, got = run(True)
    _, ref = run(False)
    assert got["1"].finish_reason == ref["1"].finish_reason == "abort"
    # the aborted request keeps what was committed: its in-flight token, if any, is dropped
    aborted, full = got.pop("1").token_ids, ref.pop("1").token_ids
    assert aborted == full[:len(aborted)] and len(full) - len(aborted) <= 1
    assert _tokens(got) == _tokens(ref)
    assert eng.metrics.num_async_steps > 5
    assert eng.metrics.num_requests_aborted == 1


class _Phases(Policy):
    """Plans γ = 0 for a few steps, then γ = 3, in turn: an adaptive policy's γ = 0 stretches
    overlap, and the step after one that drafts again commits the in-flight step first."""

    name = "phases"

    def __init__(self, max_gamma: int, zeros: int, drafts: int):
        super().__init__(max_gamma)
        self.zeros, self.drafts, self.calls = zeros, drafts, 0
        self.observed = 0
        self.notes = []  # (the observed step's plan note, the γ it ran, plans made by then)

    def plan(self, view: BatchView) -> DraftPlan:
        phase = self.calls % (self.zeros + self.drafts)
        self.calls += 1
        gamma = 0 if phase < self.zeros else 3
        return DraftPlan(gammas=np.full(view.num_decode, gamma, np.int32),
                         note={"call": self.calls, "gamma": gamma})

    def observe(self, outcome) -> None:
        self.observed += 1
        self.notes.append((outcome.plan_note, int(np.max(outcome.gammas)), self.calls))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_adaptive_policy_overlaps_its_plain_steps(engine_models, mixed_prompts, temperature):
    """Greedy: token for token the target's output. Sampled: the same as without overlap (the
    policy's plans do not depend on what it observed, so both runs draft alike). Stops end
    requests while a step on their tokens runs, also just before a step that drafts."""
    target, draft, _ = engine_models
    prompts = mixed_prompts[:8]  # all running at once: nothing waits to be admitted
    # half the requests stop on any of 37 tokens, so some end on the γ = 0 step just before a
    # step that drafts (that step then runs without them); the long prompts' outputs end at the
    # context's end
    room = [ENGINE_KW["max_model_len"] - len(p) for p in prompts]
    params = [dataclasses.replace(sp, max_tokens=min(40 + 4 * i, room[i]),
                                  stop_token_ids=list(range(3, 40)) if i % 2 else [])
              for i, sp in enumerate(_params(len(prompts), temperature))]
    results, engines = [], []
    for async_scheduling in (False, True):
        # no warm-up: the policy may plan every γ bucket but drafts only γ = 3
        eng = make_engine(target, draft, policy=_Phases(7, zeros=2, drafts=1),
                          async_scheduling=async_scheduling, warmup=False)
        results.append(_tokens(run_to_completion(eng, prompts, params)))
        engines.append(eng)
    assert results[0] == results[1]
    sync, overlapped = engines
    assert sync.metrics.num_async_steps == 0 and overlapped.metrics.num_async_steps >= 5
    assert overlapped.metrics.spec_decode_num_drafts > 0  # it did draft between the overlaps
    # every step is observed once, whether its commit came in the same call or the next
    assert overlapped.policy.observed == overlapped.metrics.policy_calls > 0
    # each step is observed with its own plan's note, though the next step was planned first
    # (a step clipped at its rows' last tokens may run fewer tokens than planned)
    notes = overlapped.policy.notes
    calls = [note["call"] for note, _, _ in notes]
    assert calls == sorted(set(calls))
    assert all(played <= note["gamma"] and (note["gamma"] or not played)
               for note, played, _ in notes)
    assert sum(note["call"] < made for note, _, made in notes) >= 5  # observed after the next plan
    if temperature == 0.0:
        plain = run_to_completion(make_engine(target, None), prompts, params)
        assert results[1] == _tokens(plain)


def test_never_where_the_policy_reads_the_host_mid_step(engine_models, ten_prompts):
    """``select`` reads the draft on the host before the verification, and stage-timed
    policies sync every stage: their steps never overlap."""

    class _Select(_Phases):
        def select(self, view, stats):
            return None

    target, draft, _ = engine_models
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng = make_engine(target, draft, policy=_Select(7, zeros=2, drafts=1), warmup=False)
    run_to_completion(eng, ten_prompts[:3], sp)
    assert eng.metrics.num_async_steps == 0
    plain = _engine(engine_models, True, draft=True, policy_options=(("gamma", 0),))
    run_to_completion(plain, ten_prompts[:3], sp)
    assert plain.metrics.num_async_steps > 0
    assert plain.metrics.policy_calls == 0  # γ = 0 by construction: nothing to plan


def test_bad_option():
    from jspec.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(async_scheduling="yes")



def test_a_busy_step_costs_the_interval_between_results(engine_models, ten_prompts):
    """While the engine is busy, a step's time runs from the previous step's results to its own:
    the work the loop does between steps (here a caller that sleeps 20 ms after each call) is
    paid by the steps, in flight or drafting alike, and the intervals never overlap, so they
    add up to no more than the loop's wall time."""
    target, draft, _ = engine_models
    eng = make_engine(target, draft, policy=_Phases(3, zeros=3, drafts=2), warmup=False)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(tag: str):
        records = []
        eng.add_step_listener(records.append)
        for i, prompt in enumerate(ten_prompts[:2]):
            eng.add_request(f"{tag}{i}", prompt, sp)
        calls, start = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            calls += 1
            time.sleep(0.02)
        eng.remove_step_listener(records.append)
        return records, calls, time.perf_counter() - start

    run("warm")  # compiles what the second run uses
    eng.policy.calls = 0
    records, calls, wall = run("")
    assert eng.metrics.num_async_steps >= 3 and eng.metrics.spec_decode_num_drafts > 0
    # the first step after idling is timed by its own stages; every sleep but the last (and
    # the first's, if its results came in a later call) falls between two steps' results
    busy = sum(r.step_time for r in records[1:])
    assert 0.02 * (calls - 2) <= busy
    assert sum(r.step_time for r in records) <= wall




def test_a_steps_record_waits_for_the_next_dispatch(engine_models, ten_prompts):
    """A committed step is recorded (metrics, policy, listeners) once the next step is
    dispatched, while the device runs it, so a step that drafts keeps that host work off the
    path between its results and the next dispatch. Once the engine idles every record is in
    place, in step order, with the queue its own commit left; with stages timed (benchmarks)
    each step is recorded in its own call."""
    target, draft, _ = engine_models
    sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 17)]
    for timed in (False, True):
        eng = make_engine(target, draft, policy=_Phases(3, zeros=2, drafts=2), warmup=False)
        eng.time_stages = timed
        commits = []
        commit = eng.committer.commit
        eng.committer.commit = lambda *a: commits.append(1) or commit(*a)
        seen = []
        eng.add_step_listener(seen.append)
        for i, prompt in enumerate(ten_prompts[:2]):
            eng.add_request(str(i), prompt, sp[i])
        behind = 0
        while eng.has_unfinished_requests():
            eng.step()
            behind = max(behind, len(commits) - len(seen))
        assert len(seen) == len(commits) == eng.metrics.num_steps
        assert behind == (0 if timed else 1)
        assert [r.num_running for r in seen][-1] == 0
        assert min(r.num_running for r in seen[:-1]) >= 1
