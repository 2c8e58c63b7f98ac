"""What benchmarks and the step-time profile do to a running engine, through one public object
(``LLMEngine.probe``) rather than by reaching into its parts: measure steps under a forced
policy with every stage timed apart, rerun a step's model work alone, wait for the device."""

from __future__ import annotations

import contextlib

import jax


class EngineProbe:
    def __init__(self, engine):
        self.engine = engine

    @contextlib.contextmanager
    def measuring(self, policy):
        """Run steps under ``policy`` with every stage timed apart (``time_stages``), elastic
        memory paused, no streamed outputs and fresh metrics; everything is restored after,
        and what the measured requests left behind is dropped (the step-time profile)."""
        e = self.engine
        saved = (e.policy, e.metrics, e.last_outcome, e.last_step, e.stream_outputs,
                 e.time_stages, e.elastic)
        # elastic memory off while measuring: γ = 0 steps on a full pool must not offload the
        # draft whose cost is being measured
        e.elastic = None
        e.policy, e.stream_outputs, e.time_stages = policy, False, True
        e.reset_metrics()
        try:
            yield e
        finally:
            (e.policy, e.metrics, e.last_outcome, e.last_step, e.stream_outputs,
             e.time_stages, e.elastic) = saved
            e.outputs.take_pending()

    def replays(self, st):
        """The model work of a step that ran (``LLMEngine.last_step``), as calls that run it
        again on the same inputs: (the target's forward, the draft loop or None). ``jspec bench
        step`` times them beside the step; the forward rewrites the same K/V, so the engine's
        state is kept."""
        draft = st.proposer.replay(st) if st.gamma and st.proposer is not None else None
        return self.engine.executor.replay_forward(st), draft

    def sync_device(self) -> None:
        """Wait for the device work dispatched so far (a step left in flight included)."""
        jax.block_until_ready(self.engine.runner.target_kv)
