"""Elastic memory (Nightjar §5): when speculation is off and KV blocks run short, offload the draft
and give its memory to the target's KV pool; when load falls, take it back and reload the draft.

This module holds the host-side part: how many target blocks the draft's memory is worth, and the
controller that decides when to expand and when to contract (§5.1). The mechanics live where the
state lives: ``BlockManager.expand`` / ``contraction_plan`` / ``contract`` (block ids),
``ModelRunner.offload_draft`` / ``expand_target_pool`` / ``contract_target_pool`` /
``reload_draft`` (device memory), and ``ElasticController`` ties them together once per step.

Two layouts of the extension (``EngineConfig.elastic_pool_layout``). Block ids keep one
numbering either way: the extension's blocks follow the base's, and the block manager keeps them
out of the free list until the pool expands.

* ``segments`` (the default on GPU and TPU): the memory really changes hands. On expansion the
  draft's weights go to host memory and its KV pool is deleted, and only then is the extension
  allocated, as a second array beside the target's base pool (``jspec.kernels.segments``); on
  contraction the live extension blocks are migrated into free base blocks, the extension array
  is deleted, and only then is the draft reloaded. The device bytes of (target KV, draft
  weights, draft KV) never exceed what the engine started with (tests/test_elastic.py counts
  them, and every live device array). The base never moves (§5.2's "in-place expansion":
  growing one array would mean holding the old and the new pool at once); only the K/V reads and
  writes split by segment. The executables for the two-segment shape (γ = 0 only: the draft is
  away), the extension's allocation and the cross-segment migration are compiled at warm-up.
* ``preallocated`` (the default on CPU): one array sized for base + extension from the start.
  On XLA:CPU "device" and host memory are the same RAM, so offloading the draft frees nothing
  to hand over and the budget is an accounting limit either way; and the jnp attention reads a
  two-segment pool by gathering from both arrays, which measured 25-40% slower per step here
  (docs/benchmarks.md, "Elastic memory").

Either way a cycle compiles nothing. The draft's own KV pool covers the base blocks only: the
draft never runs while the extension is in use, and contraction empties it before the draft
returns.

What the draft frees. Its weights and its KV pool: in this engine a KV block holds the target's
and the draft's K/V for the same token slots (one block manager, one page table per sequence), so
with the draft gone its half of every block is free too. The cost of dropping the draft's KV is
Nightjar's switching cost: after the reload the draft catches up on every running sequence's
context before it drafts again (``jspec/proposers/draft_model.py``), which the policy's ``c_prefill``
prices in through ``BatchView.pending_draft_tokens``.

Triggers (§5.1), checked before every step:

* expand when the draft is resident and each of the last ``persist_steps`` decoding steps
  (T_persist) ended with fewer than τ_low blocks free and either played γ = 0 (the paper's
  condition: speculation is off) or left requests waiting for KV blocks while the batch had room
  for more sequences (a deviation, below);
* contract when the pool is expanded, nothing waits, and more than extension + τ_low blocks are
  free (the hysteresis keeps speculation off while blocks are scarce).

τ_low = ``ceil(low_watermark x base usable blocks)``; the paper's best is 10%.

Deviation: a KV-bound queue also counts. The paper's trigger waits for the policy to turn
speculation off, which a bandit does when speculation stops paying *at the batch size the pool
allows*. When the draft's memory is large next to the pool, that batch stays small: on the
built-in pair with a 25-block pool (the draft is worth 100 more blocks) 48 queued requests ran
two or three at a time, Nightjar rightly kept γ > 0 at that batch size, and the engine preempted
48 times without ever expanding. Requests waiting on KV while the batch has free sequence slots
is the state the extension exists for, so it counts like γ = 0 does (docs/benchmarks.md,
"Elastic memory").
"""

from __future__ import annotations

import enum
import math
import time

import jax


class DraftState(enum.Enum):
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    RELOADING = "reloading"  # contraction done, weights on their way back; γ stays 0


def tree_bytes(tree) -> int:
    # each array once: a tied output head laid out "out_in" is the embedding array itself
    leaves = {id(leaf): leaf for leaf in jax.tree_util.tree_leaves(tree)}
    return sum(int(leaf.nbytes) for leaf in leaves.values())


def extension_blocks(draft_param_bytes: int, draft_kv_bytes_per_block: int,
                     target_kv_bytes_per_block: int, num_base_blocks: int) -> int:
    """Target KV blocks that the draft's memory (weights + its KV pool of ``num_base_blocks``
    blocks) is worth: M_scale = M_orig + S_draft, in blocks."""
    if target_kv_bytes_per_block <= 0:
        raise ValueError("target_kv_bytes_per_block must be positive")
    freed = draft_param_bytes + draft_kv_bytes_per_block * num_base_blocks
    return freed // target_kv_bytes_per_block


class ElasticMemory:
    """The expand / contract decisions of §5.1 (host-only, no JAX: testable alone)."""

    def __init__(self, num_base_usable: int, num_extension: int, low_watermark: float = 0.1,
                 persist_steps: int = 8) -> None:
        if num_extension < 1:
            raise ValueError(f"an elastic pool needs at least one extension block, got "
                             f"{num_extension}")
        if persist_steps < 1:
            raise ValueError(f"persist_steps must be >= 1, got {persist_steps}")
        self.num_base_usable = num_base_usable
        self.num_extension = num_extension
        self.tau_low = math.ceil(low_watermark * num_base_usable)
        self.persist_steps = persist_steps
        self.state = DraftState.RESIDENT
        self._streak = 0  # consecutive decoding steps at γ = 0 that ended short of blocks

    @property
    def draft_resident(self) -> bool:
        return self.state is DraftState.RESIDENT

    @property
    def expanded(self) -> bool:
        """The pool uses its extension exactly while the draft is offloaded (a contraction
        hands the extension back before the reload starts)."""
        return self.state is DraftState.OFFLOADED

    def observe_step(self, has_decode: bool, gamma: int, num_free: int,
                     kv_bound_queue: bool = False) -> None:
        """After each step: did it leave fewer than τ_low blocks free, with speculation off
        (γ = 0) or requests waiting for KV blocks (``kv_bound_queue``)?"""
        if not has_decode or self.state is not DraftState.RESIDENT:
            return  # prefill-only steps neither extend nor break the streak
        short = num_free < self.tau_low and (gamma == 0 or kv_bound_queue)
        self._streak = self._streak + 1 if short else 0

    def should_expand(self) -> bool:
        return self.state is DraftState.RESIDENT and self._streak >= self.persist_steps

    def should_contract(self, num_free: int, num_waiting: int) -> bool:
        return (self.expanded and num_waiting == 0
                and num_free > self.num_extension + self.tau_low)

    def expanded_now(self) -> None:
        self.state, self._streak = DraftState.OFFLOADED, 0

    def contracted_now(self) -> None:
        self.state = DraftState.RELOADING

    def reloaded_now(self) -> None:
        self.state = DraftState.RESIDENT


class ElasticController:
    """Runs §5.1's decisions on the engine's parts once per step: finish a reload that has
    landed, then expand (offload the draft, grow the target's pool) or contract (migrate the
    extension's live blocks into the base, shrink the pool, reload the draft)."""

    def __init__(self, memory: ElasticMemory, runner, block_manager, scheduler):
        self.memory = memory
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.metrics = None  # the engine's EngineMetrics, set by the engine
        self._reload_started = 0.0

    @property
    def draft_resident(self) -> bool:
        return self.memory.draft_resident

    @property
    def state(self) -> DraftState:
        return self.memory.state

    def tick(self) -> None:
        """Before a step (and once the engine falls idle)."""
        e = self.memory
        if e.state is DraftState.RELOADING and self.runner.draft_ready():
            e.reloaded_now()
            self.metrics.draft_reload_time += time.perf_counter() - self._reload_started
        if e.should_expand():
            self._expand()
        elif e.should_contract(self.block_manager.num_free_blocks, self.scheduler.num_waiting):
            self._contract()

    def observe(self, has_decode: bool, gamma: int, max_num_seqs: int) -> None:
        """After a step: its γ and the pool's state feed the expansion trigger."""
        sched = self.scheduler
        kv_bound = sched.num_waiting > 0 and sched.num_running < max_num_seqs
        self.memory.observe_step(has_decode, gamma, self.block_manager.num_free_blocks,
                                 kv_bound)

    def _expand(self) -> None:
        t0 = time.perf_counter()
        self.runner.offload_draft()
        self.runner.expand_target_pool()
        self.block_manager.expand()
        # the draft's K/V went with it: after the reload it catches up from the first token
        for seq in self.scheduler.running:
            seq.forget_draft_kv()
        self.block_manager.forget_pool_models()
        self.memory.expanded_now()
        self.metrics.num_pool_expansions += 1
        self.metrics.pool_expansion_time += time.perf_counter() - t0

    def _contract(self) -> None:
        bm = self.block_manager
        t0 = time.perf_counter()
        moves = bm.contraction_plan()
        if moves is None:  # cannot happen while free > extension + τ_low; wait if it does
            return
        self.runner.contract_target_pool(moves)
        bm.contract(moves)
        jax.block_until_ready(self.runner.target_kv)
        t1 = time.perf_counter()
        self.runner.reload_draft()
        self._reload_started = t2 = time.perf_counter()
        self.memory.contracted_now()
        self.metrics.num_pool_contractions += 1
        self.metrics.num_migrated_blocks += len(moves)
        self.metrics.pool_contraction_time += t1 - t0
        self.metrics.draft_reload_dispatch_time += t2 - t1
