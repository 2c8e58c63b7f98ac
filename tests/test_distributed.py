"""jspec/distributed.py: the leader's requests, aborts and policy decisions replayed by a
follower. Two engines in this process stand for two processes (one device each, so no
collectives): the follower, stepped after the leader over a shared in-memory key-value store,
must schedule, plan and emit exactly what the leader does, although its own policy would decide
differently."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_engine
from jspec.distributed import LeaderStopped, StepSync, follow
from jspec.sampling_params import SamplingParams
from jspec.policies.base import DraftPlan, Policy


class MemoryStore:
    """The coordinator's key-value store, as far as StepSync uses it."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.deleted: list[str] = []

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, key
        self.data[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.data:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} never came")
        return self.data[key]

    def key_value_delete(self, key):
        self.deleted.append(key)
        self.data.pop(key, None)


class Coin(Policy):
    """Draft lengths from the process's own random generator: two processes would disagree
    on every step unless the leader's plan is shared."""

    name = "coin"

    def __init__(self, max_gamma, seed):
        super().__init__(max_gamma)
        self.rng = np.random.default_rng(seed)

    def possible_gammas(self):  # the γ buckets of static γ = Γmax: executables shared
        return {0, self.max_gamma}

    def plan(self, view):
        return DraftPlan(self.max_gamma * self.rng.integers(0, 2, view.num_decode))


def test_step_sync_orders_values_and_stops():
    store = MemoryStore()
    leader, follower = StepSync(0, store), StepSync(1, store)
    for i in range(70):
        assert leader.share(lambda: {"step": i}) == {"step": i}
        assert follower.share(lambda: pytest.fail("a follower never decides")) == {"step": i}
    assert store.deleted[:2] == ["jspec/step/0", "jspec/step/1"]  # old keys collected
    assert len(store.data) == 64
    leader.stop()
    with pytest.raises(LeaderStopped):
        follower.share(lambda: None)


def test_follower_replays_requests_aborts_and_plans(engine_models):
    target, draft, _ = engine_models
    store = MemoryStore()
    leader = make_engine(target, draft, policy=Coin(7, seed=1))
    follower = make_engine(target, draft, policy=Coin(7, seed=2))
    leader.set_step_sync(StepSync(0, store))
    follower.set_step_sync(StepSync(1, store))
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)  # seeds replayed
    outputs = {"leader": {}, "follower": {}}
    prompts = [rng.integers(3, 256, 12 + 9 * i).tolist() for i in range(5)]
    for i, prompt in enumerate(prompts):
        leader.add_request(str(i), prompt, greedy if i % 2 else sampled)
    steps = 0
    while leader.has_unfinished_requests():
        if steps == 3:
            leader.abort_request("4")
        if steps == 5:  # prompt 3's blocks are cached by now, but not under this salt
            leader.add_request("late", prompts[3], sampled, cache_salt="tenant")
        for who, engine in (("leader", leader), ("follower", follower)):
            for out in engine.step():
                if out.finished:
                    outputs[who][out.request_id] = (list(out.token_ids), out.finish_reason)
        steps += 1
    leader.sync.stop()
    assert follow(follower) == 0 and not follower.has_unfinished_requests()
    assert outputs["follower"] == outputs["leader"] and len(outputs["leader"]) == 6
    assert outputs["leader"]["4"][1] == "abort"
    assert follower.block_manager.stats == leader.block_manager.stats  # the salt was replayed
    # the follower drafted what the leader's policy chose, not what its own would have
    np.testing.assert_array_equal(follower.metrics.gamma_histogram,
                                  leader.metrics.gamma_histogram)
    assert leader.metrics.spec_decode_num_accepted_tokens > 0
