"""A policy's learned state (bandit statistics, EMAs) as a JSON file, so a restarted engine
continues from it (``LLMEngine.save_policy_state`` / ``load_policy_state``)."""

from __future__ import annotations

import json
import os

from jspec.jsonfile import read_json
from jspec.policies import Policy


def save(policy: Policy, path: str) -> None:
    state = {"policy": policy.name, "max_gamma": policy.max_gamma,
             "state": policy.state_dict()}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)  # never leave a half-written file behind


def load(policy: Policy, path: str) -> None:
    saved = read_json(path, "policy state")
    if not isinstance(saved, dict) or "state" not in saved:
        raise ValueError(f"{path!r} is not a jspec policy state file")
    if saved.get("policy") != policy.name:
        raise ValueError(f"policy state {path!r} belongs to policy {saved.get('policy')!r}, "
                         f"the engine runs {policy.name!r}")
    policy.load_state_dict(saved["state"])
