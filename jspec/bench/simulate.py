"""`jspec bench simulate`: every adaptive policy against the fixed arms in simulated environments
(jspec/policy_sim.py): per environment, each policy's throughput over the best fixed arm in
hindsight, worst seed and mean. Host-only and seeded: no model, no device, no wall clock."""

from jspec.policy_sim import add_arguments, run

__all__ = ["add_arguments", "run"]
