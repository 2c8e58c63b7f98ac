"""Randomized serving workloads: invariants after every step, no leaks, no compiles after
warm-up."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ENGINE_VOCAB, make_engine
from jspec import runner
from jspec.sampling_params import SamplingParams
from test_engine_lossless import RandomGammaPolicy

_ENGINES = {}


def _engine(engine_models, kind):
    """One engine per kind for the whole module (engines are reusable between workloads)."""
    if kind not in _ENGINES:
        target, draft, _ = engine_models
        if kind == "tiny-pool":  # forces preemption; same shapes as the lossless preemption test
            _ENGINES[kind] = make_engine(target, draft, policy_options=(("gamma", 3),),
                                         num_kv_blocks=16)
        else:
            _ENGINES[kind] = make_engine(target, draft, policy=RandomGammaPolicy(7, seed=1))
    return _ENGINES[kind]


workload = st.lists(
    st.tuples(
        st.integers(0, 4),  # arrival: steps to wait before adding this request
        st.integers(1, 100),  # prompt length
        st.integers(1, 20),  # max_tokens
        st.sampled_from([0.0, 0.0, 1.0]),  # temperature
        st.one_of(st.none(), st.integers(0, 30)),  # abort after this many steps (None: never)
    ),
    min_size=1, max_size=14,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workload, kind=st.sampled_from(["random-gamma", "tiny-pool"]),
       seed=st.integers(0, 2**16))
def test_random_arrivals_and_aborts_keep_invariants_and_free_everything(
        engine_models, workload, kind, seed):
    engine = _engine(engine_models, kind)
    rng = np.random.default_rng(seed)
    bm = engine.block_manager
    pending = [(i, *item) for i, item in enumerate(workload)]
    live: dict[str, int | None] = {}  # request id -> step at which to abort
    finished: dict[str, str] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1] <= 0:
            i, _, length, max_tokens, temperature, abort_after = pending.pop(0)
            rid = f"w{seed}-{i}"
            prompt = rng.integers(3, ENGINE_VOCAB, length).tolist()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=temperature,
                                                           seed=i, ignore_eos=True))
            live[rid] = None if abort_after is None else step + abort_after
        if pending:
            pending[0] = (pending[0][0], pending[0][1] - 1, *pending[0][2:])
        for rid, when in list(live.items()):
            if when is not None and when <= step and rid not in finished:
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
                live.pop(out.request_id, None)
                assert out.finish_reason in ("length", "abort")
        engine.scheduler.check_invariants()
        step += 1
        assert step < 2000
    assert set(finished) == {f"w{seed}-{i}" for i in range(len(workload))}
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_no_compilation_after_warmup(engine_models, mixed_prompts):
    """A fresh engine compiles everything at start-up; serving new prompts of new lengths with
    every sampling mode, logprobs, mixed γ (so draft catch-up), and aborts compiles nothing."""
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=RandomGammaPolicy(7, seed=5))
    before = runner.compile_events()
    rng = np.random.default_rng(11)
    modes = [SamplingParams(max_tokens=16, temperature=0.0),
             SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, logprobs=2),
             SamplingParams(max_tokens=16, temperature=1.2, top_k=5, seed=3)]
    for round_ in range(2):
        for i in range(12):
            length = int(rng.integers(1, 110))
            engine.add_request(f"c{round_}-{i}", rng.integers(3, ENGINE_VOCAB, length).tolist(),
                               modes[i % 3])
        engine.step()
        engine.abort_request(f"c{round_}-0")
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.metrics.catch_up_tokens > 0
    assert runner.compile_events() == before, "serving compiled after warm-up"
    assert engine.block_manager.num_used_blocks == 0
