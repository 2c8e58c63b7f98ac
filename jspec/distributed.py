"""Several hosts, one engine: JAX's multi-controller runtime with the host side led by process 0.

``jax.distributed.initialize`` joins the processes (one per host) into one JAX runtime whose
``jax.devices()`` lists every host's devices; the tensor-parallel mesh (models/sharding.py) then
spans the hosts and XLA runs the collectives between them. JAX is multi-controller: every
process must issue the same computations in the same order with the same replicated inputs.
The engine's host side is deterministic given what it is told (requests, aborts) and what its
policy decides, so only those cross the processes: process 0, the leader, serves the API and
runs the policy; at every step it publishes, through the coordinator's key-value store, the
requests and aborts since the last step and each policy decision; the followers (every other
process) run the same engine on the same command line and take those instead of deciding
themselves (``StepSync``). Scheduling, block allocation, seeds and commits then happen the same
way everywhere, and the device calls line up. A follower does nothing but follow
(``follow``); when the leader stops it publishes a stop, and the followers return.

Every step costs one key-value round trip to the coordinator per decision (two per step: the
events and the plan), a few hundred microseconds on a LAN; the step's collectives dwarf it.
"""

from __future__ import annotations

import argparse
import pickle
from typing import Any, Callable

# how long a follower waits per poll for the leader's next step before asking again; a server
# may idle for hours between requests, so a poll that times out just polls again
_POLL_MS = 60_000
# keys kept in the store behind the newest: a follower is never more than one step behind the
# leader (the leader's next device call waits for every process), so older keys are garbage
_KEEP_KEYS = 64


class LeaderStopped(Exception):
    """Raised in a follower's step when the leader has shut down."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "several hosts (jax.distributed; docs/distributed.md)")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", default=None,
                       help="process 0's address, the same on every host")
    group.add_argument("--num-processes", type=int, default=None, metavar="N",
                       help="processes (hosts) taking part")
    group.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's rank: 0 leads (serves the API), the others follow")


def check_arguments(args: argparse.Namespace) -> bool:
    """Whether this is a multi-process run; a ValueError for an incomplete or inconsistent set
    of flags. Needs no JAX."""
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if all(v is None for v in given):
        return False
    if any(v is None for v in given):
        raise ValueError("--coordinator-address, --num-processes and --process-id go together: "
                         "give all three (the same address and count on every host)")
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), got "
                         f"{args.process_id}")
    tp = getattr(args, "tensor_parallel_size", None) or 1
    if tp % args.num_processes:
        raise ValueError(f"--tensor-parallel-size {tp} must be a multiple of --num-processes "
                         f"{args.num_processes}: the mesh spans every process's devices")
    return True


def initialize(args: argparse.Namespace) -> "StepSync":
    """Join the processes (before anything starts JAX's backend; ``args`` passed
    ``check_arguments``) and check that the mesh will cover every device of every process."""
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
    tp = getattr(args, "tensor_parallel_size", None) or 1
    if tp != jax.device_count():
        raise ValueError(f"--tensor-parallel-size {tp} must equal the devices of all processes "
                         f"together ({jax.device_count()}: {jax.local_device_count()} here x "
                         f"{args.num_processes} processes): every process must take part in "
                         "every step")
    return StepSync(args.process_id)


def _client():
    from jax._src import distributed  # the runtime's client: no public accessor in jax 0.10

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class StepSync:
    """The leader's host-side decisions, published in order under numbered keys; followers read
    them in the same order. ``client``: the coordinator's key-value store (tests pass a fake)."""

    def __init__(self, process_id: int, client=None, prefix: str = "jspec/step"):
        self.leader = process_id == 0
        self._client = client
        self._prefix = prefix
        self._next = 0

    @property
    def client(self):
        if self._client is None:
            self._client = _client()
        return self._client

    def share(self, compute: Callable[[], Any]) -> Any:
        """The leader's ``compute()``, on every process: the leader computes and publishes it,
        a follower waits for it (raising LeaderStopped after the leader's ``stop``)."""
        key = f"{self._prefix}/{self._next}"
        self._next += 1
        if self.leader:
            value = compute()
            self.client.key_value_set_bytes(key, pickle.dumps(("value", value)))
            if self._next > _KEEP_KEYS:
                self.client.key_value_delete(f"{self._prefix}/{self._next - 1 - _KEEP_KEYS}")
            return value
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        kind, value = pickle.loads(data)
        if kind == "stop":
            raise LeaderStopped()
        return value

    def stop(self) -> None:
        """Leader: tell the followers to return (they are waiting on the next key)."""
        if self.leader:
            key = f"{self._prefix}/{self._next}"
            self.client.key_value_set_bytes(key, pickle.dumps(("stop", None)))


class EngineEvents:
    """An engine's side of a multi-process run: the leader records its requests and aborts and
    shares them before every step, a follower replays them through its own ``add_request`` /
    ``abort_request``; policy decisions are the leader's (``decide``)."""

    def __init__(self, sync: StepSync):
        self.sync = sync
        self._events: list[tuple] = []

    def record(self, *event) -> None:
        if self.sync.leader:
            self._events.append(event)

    def replay(self, engine) -> None:
        events = self.sync.share(self._take)
        if self.sync.leader:
            return
        for event in events:
            if event[0] == "add":
                _, request_id, token_ids, sampling_params, cache_salt = event
                engine.add_request(request_id, token_ids, sampling_params,
                                   cache_salt=cache_salt)
            else:
                engine.abort_request(event[1])

    def decide(self, compute: Callable[[], Any]) -> Any:
        return self.sync.share(compute)

    def stop(self) -> None:
        """The leader is done: followers' next step raises LeaderStopped."""
        self.sync.stop()

    def _take(self) -> list[tuple]:
        events, self._events = self._events, []
        return events


def follow(engine) -> int:
    """A follower's life: step whenever the leader steps, until it stops. Returns the steps."""
    steps = 0
    try:
        while True:
            engine.step()
            steps += 1
    except LeaderStopped:
        return steps
