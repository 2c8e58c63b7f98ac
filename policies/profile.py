"""Step-time profile of one target/draft pair on one machine (written by `jspec profile`).

Policies that reason about cost (AdaSpec, DSD, Nightjar's switching cost) read it:

* ``target_time[b, q, l]``: seconds of one target forward over ``batch_sizes[b]`` sequences,
  each bringing ``query_lens[q]`` new tokens (1 = decode, γ+1 = verification), at context
  ``context_lens[l]``.
* ``draft_time[b, l]``: seconds of one draft forward of one token per sequence (one step of the
  autoregressive draft loop).
* ``catch_up_time[c, b]``: seconds the draft needs to catch up on ``catch_up_lens[c]`` tokens
  per sequence for ``batch_sizes[b]`` sequences: Nightjar's c_prefill(L, B), the prefill time
  with speculation minus without (the target's part is the same either way, so the difference
  is the draft's catch-up forward).

Lookups interpolate linearly on every axis and extrapolate linearly past the grid from the last
two points (step time keeps growing with load; a lookup past the grid must not crash or clamp),
never returning less than a small positive floor. Policies ask for the same points step after
step, so lookups are memoised, with the context rounded to whole tokens (``CONTEXT_QUANTUM``; a change
far below what the profile resolves); the other coordinates are keys as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

FORMAT = "jspec-step-profile-v1"
_FLOOR = 1e-6  # seconds
CONTEXT_QUANTUM = 1  # whole tokens: grid points stay exact
_CACHE_LIMIT = 1 << 14


def _axis_weights(grid: np.ndarray, x: float) -> list[tuple[int, float]]:
    """Indices and weights of linear interpolation along one axis (extrapolating outside)."""
    n = len(grid)
    if n == 1:
        return [(0, 1.0)]
    i = int(np.searchsorted(grid, x, side="right")) - 1
    i = min(max(i, 0), n - 2)
    x0, x1 = float(grid[i]), float(grid[i + 1])
    t = (x - x0) / (x1 - x0)
    return [(i, 1.0 - t), (i + 1, t)]


def interpolate(axes: Sequence[np.ndarray], values: np.ndarray, point: Sequence[float]) -> float:
    """Multilinear interpolation of ``values`` (shape = axis lengths) at ``point``, with linear
    extrapolation past the ends of each axis."""
    weights = [_axis_weights(np.asarray(a, float), float(x)) for a, x in zip(axes, point)]
    total = 0.0

    def walk(dim: int, index: tuple, w: float):
        nonlocal total
        if dim == len(weights):
            total += w * float(values[index])
            return
        for i, wi in weights[dim]:
            walk(dim + 1, index + (i,), w * wi)

    walk(0, (), 1.0)
    return max(total, _FLOOR)


@dataclasses.dataclass
class StepProfile:
    target: str  # model descriptions (config summary), checked against the engine's
    draft: str
    device: str
    dtype: str
    batch_sizes: list[int]
    query_lens: list[int]
    context_lens: list[int]
    catch_up_lens: list[int]
    target_time: np.ndarray  # [B, Q, L]
    draft_time: np.ndarray  # [B, L]
    catch_up_time: np.ndarray  # [C, B]
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.target_time = np.asarray(self.target_time, float)
        self.draft_time = np.asarray(self.draft_time, float)
        self.catch_up_time = np.asarray(self.catch_up_time, float)
        for name in ("batch_sizes", "query_lens", "context_lens", "catch_up_lens"):
            axis = list(getattr(self, name))
            if not axis or sorted(set(axis)) != axis:
                raise ValueError(f"profile {name} must be strictly increasing, got {axis}")
        shapes = {"target_time": (len(self.batch_sizes), len(self.query_lens),
                                  len(self.context_lens)),
                  "draft_time": (len(self.batch_sizes), len(self.context_lens)),
                  "catch_up_time": (len(self.catch_up_lens), len(self.batch_sizes))}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"profile {name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape}")

    # ------------------------------------------------------------------ lookups
    def _lookup(self, kind: str, axes, values, point) -> float:
        *rest, context = point
        key = (kind, *(float(x) for x in rest),
               int(round(float(context) / CONTEXT_QUANTUM)))
        cache = self._cache
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            hit = cache[key] = interpolate(axes, values, (*key[1:-1],
                                                          key[-1] * CONTEXT_QUANTUM))
        return hit

    def target_step(self, batch_size: float, query_len: float, context: float) -> float:
        return self._lookup("t", (self.batch_sizes, self.query_lens, self.context_lens),
                            self.target_time, (batch_size, query_len, context))

    def draft_step(self, batch_size: float, context: float) -> float:
        return self._lookup("d", (self.batch_sizes, self.context_lens), self.draft_time,
                            (batch_size, context))

    def step_time(self, batch_size: float, gamma: int, context: float) -> float:
        """Predicted time of a step where every sequence drafts ``gamma`` tokens (γ draft
        forwards, then one target forward over γ+1 tokens per sequence); γ = 0 is plain decode."""
        t = self.target_step(batch_size, gamma + 1, context)
        if gamma > 0:
            t += gamma * self.draft_step(batch_size, context)
        return t

    def target_steps(self, batch_size: float, query_lens, context: float) -> np.ndarray:
        """``target_step`` at many query lengths in one numpy pass. At fixed (B, L) the
        multilinear lookup is piecewise linear in q (linear extrapolation past the ends), so its
        values at the grid's query lengths reproduce it exactly; policies that score every γ or
        every verify length each step call this rather than one scalar lookup per point."""
        q = np.asarray(query_lens, float)
        grid = np.asarray(self.query_lens, float)
        at_grid = np.array([self.target_step(batch_size, g, context) for g in grid])
        if len(grid) == 1:
            return np.full(q.shape, at_grid[0])
        i = np.clip(np.searchsorted(grid, q, side="right") - 1, 0, len(grid) - 2)
        t = (q - grid[i]) / (grid[i + 1] - grid[i])
        return np.maximum((1.0 - t) * at_grid[i] + t * at_grid[i + 1], _FLOOR)

    def step_times(self, batch_size: float, gammas, context: float) -> np.ndarray:
        """``step_time`` for many γ at once (``target_steps`` plus γ draft steps)."""
        gammas = np.asarray(gammas, float)
        draft = self.draft_step(batch_size, context) if np.any(gammas) else 0.0
        return self.target_steps(batch_size, gammas + 1.0, context) + gammas * draft

    def c_prefill(self, catch_up_len: float, batch_size: float) -> float:
        """Nightjar's switching cost: seconds to resume speculation after ``catch_up_len`` tokens
        per sequence were generated without the draft (0 tokens cost nothing)."""
        if catch_up_len <= 0:
            return 0.0
        return interpolate((self.catch_up_lens, self.batch_sizes), self.catch_up_time,
                           (catch_up_len, batch_size))

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        out = {"format": FORMAT}
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            v = getattr(self, f.name)
            out[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
        return out

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StepProfile":
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read step profile {str(path)!r}: {e.strerror or e}; "
                             "create one with `jspec profile --out PROFILE.json`") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"step profile {str(path)!r} is not JSON ({e.msg})") from None
        if data.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a jspec step profile (format "
                             f"{data.get('format')!r}, expected {FORMAT!r})")
        data.pop("format")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        missing = names - set(data)
        if missing:
            raise ValueError(f"step profile {str(path)!r} lacks {sorted(missing)}")
        return cls(**{k: data[k] for k in names})

    def check_models(self, target: str, draft: str) -> None:
        """Refuse a profile measured for other models."""
        if (self.target, self.draft) != (target, draft):
            raise ValueError(f"the step profile was measured for target {self.target!r} / draft "
                             f"{self.draft!r}, but the engine runs {target!r} / {draft!r}; "
                             "re-run `jspec profile` for these models")


def model_signature(cfg) -> str:
    """A short description of a model config that identifies its cost (shape and vocab)."""
    return (f"{cfg.model_type} L{cfg.num_layers} h{cfg.hidden_size} heads{cfg.num_heads}/"
            f"{cfg.num_kv_heads}x{cfg.head_dim} ffn{cfg.intermediate_size} v{cfg.vocab_size}")


def load_profile(policy: str, profile: "str | os.PathLike | StepProfile | None"
                 ) -> StepProfile | None:
    """The profile a policy was given: a StepProfile, the path of one, or None (none given: an
    engine measures one, jspec/autoprofile.py)."""
    if profile is None:
        return None
    if not isinstance(profile, (str, os.PathLike, StepProfile)):
        raise ValueError(f"{policy} option profile must be a path to a step profile or a "
                         f"StepProfile, got {type(profile).__name__}")
    if isinstance(profile, StepProfile):
        return profile
    return StepProfile.load(profile)
