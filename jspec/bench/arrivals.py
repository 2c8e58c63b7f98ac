"""Arrival times for the serving benchmarks: synthetic processes and Azure trace replay.

Every generator returns an ``Arrivals``: sorted arrival times in seconds after the benchmark's
start (and, for a trace, each request's context and generated token counts). Each stops at
``duration`` seconds (arrivals at t < duration) and/or after ``num_requests`` arrivals, whichever
comes first; an open-ended process needs at least one of the two.

* ``poisson(rate)``: a Poisson process, i.i.d. exponential gaps of mean 1/rate from t = 0 (the
  first request arrives after one gap), seeded. ``process="regular"`` instead spaces arrivals
  exactly 1/rate apart starting at t = 0 (a constant-rate load without randomness).
* ``batch(n)``: n requests at t = 0: offline throughput.
* ``step(segments)``: a piecewise-constant rate, ``[(t0=0, r0), (t1, r1), ...]``: rate r_k on
  [t_k, t_{k+1}), the last rate until the end. Each segment is its own Poisson process (exact,
  since the process is memoryless) or, with ``process="regular"``, arrivals at t_k + j/r_k
  inside the segment (ceil(r_k · length) of them). A rate of 0 is an idle segment.
* ``burst(period, size)``: ``size`` requests at once at t = 0, period, 2·period, ..., optionally
  over a background Poisson (or regular) process (``Background``).
* ``trace_arrivals(read_azure_trace(path))``: replay of an Azure LLM inference trace, see below.

Azure traces (``AzureLLMInferenceTrace_{code,conv}.csv``, Splitwise, ISCA'24): header
``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps like ``2023-11-16 18:17:03.9799600``
(7 fractional digits, no time zone), CRLF line endings, no final newline. ``read_azure_trace``
parses every row exactly (the fractional digits are read as written, not through ``datetime``,
which keeps only 6) into seconds after the first row. ``trace_arrivals`` then applies, in order:

1. window: keep rows with window_start ≤ t < window_start + window_duration (trace seconds),
   and shift so window_start becomes t = 0;
2. rate scale r (thin or replicate, keeping the trace's time axis): row i is sent
   c_i = floor((i+1)·r) − floor(i·r) times, so the window's N rows become floor(N·r) requests,
   spread evenly (r = 0.25 keeps every 4th row, r = 2 sends each row twice); the c_i copies of
   row i are spaced evenly over [t_i, t_{i+1}) (the last row's copies all at t_i), each with
   row i's token counts. Deterministic: no randomness to seed;
3. time scale s: t → s·t (s = 10 replays 1 trace minute over 10 minutes, at a tenth of the
   rate; s = 0.5 replays it twice as fast, at double the rate);
4. max requests: the first ``max_requests`` arrivals.

So the replayed rate is r/s times the trace's. Token counts are kept as recorded; fitting them to
an engine's context limit is ``jspec.bench.workloads.fit_lengths``'s job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from datetime import datetime
from pathlib import Path

import numpy as np

PROCESSES = ("poisson", "regular")
TRACE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TRACE_FILES = {"code": "AzureLLMInferenceTrace_code.csv",
               "conv": "AzureLLMInferenceTrace_conv.csv"}
_TIMESTAMP = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?$")


@dataclasses.dataclass
class Arrivals:
    times: np.ndarray  # [n] seconds after the start, sorted
    kind: str
    params: dict
    context_tokens: np.ndarray | None = None  # [n], traces only
    generated_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.times)

    @property
    def label(self) -> str:
        """Short human description, used for plot legends and tables."""
        p = self.params
        if self.kind == "poisson":
            return f"{p['process']} {p['rate']:g} req/s"
        if self.kind == "batch":
            return f"batch of {len(self)}"
        if self.kind == "step":
            return "step " + " → ".join(f"{r:g}" for _, r in p["segments"]) + " req/s"
        if self.kind == "burst":
            return f"burst {p['size']} every {p['period']:g} s"
        if self.kind == "trace":
            return f"{p['trace']} trace ×{p['rate_scale']:g} rate, ×{p['time_scale']:g} time"
        return self.kind

    def describe(self) -> dict:
        times = self.times
        span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
        return {"kind": self.kind, "label": self.label, "params": self.params,
                "num_requests": len(times),
                "first": float(times[0]) if len(times) else None,
                "last": float(times[-1]) if len(times) else None,
                "mean_rate": (len(times) - 1) / span if span > 0 else None}


def _check_limits(duration: float | None, num_requests: int | None, open_ended: bool) -> None:
    if duration is not None and not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a positive number of seconds, got {duration}")
    if num_requests is not None and (not isinstance(num_requests, (int, np.integer))
                                     or num_requests < 1):
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    if open_ended and duration is None and num_requests is None:
        raise ValueError("give a duration or a number of requests (the process never ends)")


def _check_process(process: str) -> None:
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {', '.join(PROCESSES)}, got {process!r}")


def _segment_times(rng: np.random.Generator, start: float, end: float, rate: float,
                   process: str, limit: int | None) -> np.ndarray:
    """Arrivals of one constant-rate process on [start, end) (end may be inf when limit is set),
    at most ``limit`` of them."""
    if rate == 0:
        return np.zeros(0)
    if process == "regular":
        if math.isinf(end):
            count = limit
        else:
            count = math.ceil((end - start) * rate - 1e-9)
            if limit is not None:
                count = min(count, limit)
        return start + np.arange(count) / rate
    out, t = [], start
    while limit is None or len(out) < limit:
        # draw gaps in blocks: a few numpy calls instead of one per request
        want = 1024 if limit is None else max(limit - len(out), 1)
        if not math.isinf(end):
            want = max(int((end - t) * rate * 1.2) + 16, 16)
        gaps = rng.exponential(1.0 / rate, size=want)
        times = t + np.cumsum(gaps)
        times = times[times < end]
        out.extend(times.tolist())
        if len(times) < want:  # crossed the end
            break
        t = float(times[-1])
    if limit is not None:
        out = out[:limit]
    return np.asarray(out, float)


def poisson(rate: float, *, duration: float | None = None, num_requests: int | None = None,
            seed: int = 0, process: str = "poisson") -> Arrivals:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    _check_process(process)
    _check_limits(duration, num_requests, open_ended=True)
    rng = np.random.default_rng(seed)
    end = duration if duration is not None else math.inf
    times = _segment_times(rng, 0.0, end, rate, process, num_requests)
    return Arrivals(times, "poisson", {"rate": rate, "process": process, "seed": seed,
                                       "duration": duration, "num_requests": num_requests})


def batch(num_requests: int) -> Arrivals:
    _check_limits(None, num_requests, open_ended=False)
    if num_requests is None:
        raise ValueError("a batch needs a number of requests")
    return Arrivals(np.zeros(num_requests), "batch", {"num_requests": num_requests})


def parse_segments(text: str) -> list[tuple[float, float]]:
    """``"0:1,30:4,60:1"`` -> [(0, 1), (30, 4), (60, 1)] (start second : rate)."""
    segments = []
    for item in text.split(","):
        start, sep, rate = item.partition(":")
        try:
            if not sep:
                raise ValueError
            segments.append((float(start), float(rate)))
        except ValueError:
            raise ValueError(f"step segments are START:RATE pairs separated by commas, e.g. "
                             f"0:1,30:4; got {item!r}") from None
    return segments


def step(segments: list[tuple[float, float]], *, duration: float | None = None,
         num_requests: int | None = None, seed: int = 0, process: str = "poisson") -> Arrivals:
    _check_process(process)
    _check_limits(duration, num_requests, open_ended=True)
    if not segments:
        raise ValueError("a step pattern needs at least one (start, rate) segment")
    starts = [float(s) for s, _ in segments]
    rates = [float(r) for _, r in segments]
    if starts[0] != 0:
        raise ValueError(f"the first step segment must start at 0, got {starts[0]}")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"step segment starts must increase, got {starts}")
    if any(not (r >= 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"step rates must be finite and >= 0, got {rates}")
    if duration is None and rates[-1] == 0:
        raise ValueError("the last step rate is 0: give a duration")
    if duration is not None and starts[-1] >= duration:
        raise ValueError(f"step segment start {starts[-1]} is not before duration {duration}")
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    for k, (start, rate) in enumerate(zip(starts, rates)):
        end = starts[k + 1] if k + 1 < len(starts) else (
            duration if duration is not None else math.inf)
        limit = None if num_requests is None else num_requests - have
        if limit == 0:
            break
        times = _segment_times(rng, start, end, rate, process, limit)
        parts.append(times)
        have += len(times)
    times = np.concatenate(parts) if parts else np.zeros(0)
    return Arrivals(times, "step", {"segments": [[s, r] for s, r in zip(starts, rates)],
                                    "process": process, "seed": seed, "duration": duration,
                                    "num_requests": num_requests})


@dataclasses.dataclass(frozen=True)
class Background:
    """The constant-rate process under a burst pattern: ``rate`` requests per second (0: none),
    a seeded Poisson process or a regular one."""

    rate: float = 0.0
    process: str = "poisson"
    seed: int = 0


def burst(period: float, size: int, *, duration: float | None = None,
          num_requests: int | None = None, background: Background = Background()) -> Arrivals:
    base_rate, process, seed = background.rate, background.process, background.seed
    if not (period > 0 and math.isfinite(period)):
        raise ValueError(f"burst period must be a positive number of seconds, got {period}")
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"burst size must be a positive integer, got {size!r}")
    if not (base_rate >= 0 and math.isfinite(base_rate)):
        raise ValueError(f"base rate must be finite and >= 0, got {base_rate}")
    _check_process(process)
    _check_limits(duration, num_requests, open_ended=True)
    if duration is None:
        # enough periods to reach num_requests from the bursts alone
        num_bursts = -(-num_requests // size)
        end = num_bursts * period
    else:
        num_bursts = math.ceil(duration / period - 1e-9)
        end = duration
    bursts = np.repeat(np.arange(num_bursts) * period, size)
    background = _segment_times(np.random.default_rng(seed), 0.0, end, base_rate, process, None) \
        if base_rate > 0 else np.zeros(0)
    # stable sort: at equal times the burst requests come first
    times = np.sort(np.concatenate([bursts, background]), kind="stable")
    if num_requests is not None:
        times = times[:num_requests]
    return Arrivals(times, "burst", {"period": period, "size": size, "base_rate": base_rate,
                                     "process": process, "seed": seed, "duration": duration,
                                     "num_requests": num_requests})


# ----------------------------------------------------------------------------- Azure traces
@dataclasses.dataclass
class AzureTrace:
    path: str
    start: str  # the first row's timestamp, as written
    timestamps: np.ndarray  # [n] seconds after the first row
    context_tokens: np.ndarray  # [n] int64
    generated_tokens: np.ndarray  # [n] int64

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def name(self) -> str:
        for key, file in TRACE_FILES.items():
            if os.path.basename(self.path) == file:
                return key
        return os.path.basename(self.path)


def trace_path(name_or_path: str) -> Path:
    """A shipped trace's name (its file in the shared data directory) or any CSV's path."""
    from jspec.bench.workloads import data_dir

    if name_or_path in TRACE_FILES:
        return data_dir() / TRACE_FILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() != ".csv" and not path.exists():
        raise ValueError(f"unknown trace {name_or_path!r}: give a shipped trace "
                         f"({', '.join(TRACE_FILES)}) or the path of a CSV in the Azure trace "
                         "format")
    return path


def _timestamp_seconds(text: str, where: str) -> tuple[int, float]:
    """(whole seconds on a day-ordinal clock, fraction) of a trace timestamp, exactly."""
    m = _TIMESTAMP.match(text)
    if m is None:
        raise ValueError(f"{where}: timestamp {text!r} is not YYYY-MM-DD HH:MM:SS[.fraction]")
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        day = datetime(y, mo, d, h, mi, s).toordinal()
    except ValueError as e:
        raise ValueError(f"{where}: timestamp {text!r}: {e}") from None
    frac = m.group(7)
    return day * 86400 + h * 3600 + mi * 60 + s, int(frac) / 10 ** len(frac) if frac else 0.0


def read_azure_trace(path: str | os.PathLike) -> AzureTrace:
    """Parse an Azure LLM inference trace CSV (CRLF or LF, final newline or not)."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"trace file {path!r} not found (set JSPEC_DATA_DIR or pass the path)"
                         ) from None
    except OSError as e:
        raise ValueError(f"cannot read trace file {path!r}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"trace file {path!r} is not UTF-8 text") from None
    lines = text.splitlines()  # CRLF, LF and a missing final newline all split the same
    if not lines or tuple(c.strip() for c in lines[0].split(",")) != TRACE_HEADER:
        got = lines[0] if lines else "(empty file)"
        raise ValueError(f"trace file {path!r}: header must be {','.join(TRACE_HEADER)}, got "
                         f"{got!r}")
    whole, frac, ctx, gen = [], [], [], []
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        fields = line.split(",")
        where = f"{path}:{number}"
        if len(fields) != 3:
            raise ValueError(f"{where}: expected 3 fields, got {len(fields)}")
        w, f_ = _timestamp_seconds(fields[0].strip(), where)
        try:
            c, g = int(fields[1]), int(fields[2])
        except ValueError:
            raise ValueError(f"{where}: token counts must be integers, got {fields[1]!r}, "
                             f"{fields[2]!r}") from None
        if c < 0 or g < 0:
            raise ValueError(f"{where}: token counts must be >= 0")
        whole.append(w)
        frac.append(f_)
        ctx.append(c)
        gen.append(g)
    if not whole:
        raise ValueError(f"trace file {path!r} holds no requests")
    # subtract whole seconds as integers first, so 7-digit fractions survive in float64
    seconds = (np.asarray(whole, np.int64) - whole[0]).astype(float) + np.asarray(frac) - frac[0]
    if np.any(np.diff(seconds) < 0):
        i = int(np.argmax(np.diff(seconds) < 0)) + 3
        raise ValueError(f"{path}:{i}: timestamps must not decrease")
    return AzureTrace(path=path, start=lines[1].split(",")[0].strip(), timestamps=seconds,
                      context_tokens=np.asarray(ctx, np.int64),
                      generated_tokens=np.asarray(gen, np.int64))


def trace_arrivals(trace: AzureTrace, *, time_scale: float = 1.0, rate_scale: float = 1.0,
                   window_start: float = 0.0, window_duration: float | None = None,
                   max_requests: int | None = None) -> Arrivals:
    """Replay a trace: window, rate scale, time scale, max requests (module docstring)."""
    for name, value in (("time_scale", time_scale), ("rate_scale", rate_scale)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value}")
    if not (window_start >= 0 and math.isfinite(window_start)):
        raise ValueError(f"window start must be >= 0 seconds, got {window_start}")
    if window_duration is not None and not (window_duration > 0):
        raise ValueError(f"window duration must be > 0 seconds, got {window_duration}")
    _check_limits(None, max_requests, open_ended=False)
    t = trace.timestamps
    end = math.inf if window_duration is None else window_start + window_duration
    keep = (t >= window_start) & (t < end)
    t = t[keep] - window_start
    ctx, gen = trace.context_tokens[keep], trace.generated_tokens[keep]
    if len(t) == 0:
        raise ValueError(f"the trace window [{window_start}, {end}) s holds no requests (the "
                         f"trace spans {trace.timestamps[-1]:.0f} s)")
    # systematic thinning / replication: c_i copies of row i, sum = floor(N * r)
    cum = np.floor(np.arange(len(t) + 1) * rate_scale + 1e-9).astype(np.int64)
    copies = np.diff(cum)
    idx = np.repeat(np.arange(len(t)), copies)
    if len(idx) == 0:
        raise ValueError(f"rate_scale={rate_scale} keeps none of the window's {len(t)} requests")
    # copy j of row i at t_i + j * gap_i / c_i, gap_i = t_{i+1} - t_i (0 for the last row)
    gaps = np.append(np.diff(t), 0.0)
    first_copy = np.repeat(cum[:-1], copies)
    j = np.arange(len(idx)) - first_copy
    times = t[idx] + j * gaps[idx] / copies[idx]
    times = times * time_scale
    ctx, gen = ctx[idx], gen[idx]
    if max_requests is not None:
        times, ctx, gen = times[:max_requests], ctx[:max_requests], gen[:max_requests]
    params = {"trace": trace.name, "path": trace.path, "trace_start": trace.start,
              "time_scale": time_scale, "rate_scale": rate_scale, "window_start": window_start,
              "window_duration": window_duration, "max_requests": max_requests,
              "trace_rows_in_window": int(keep.sum())}
    return Arrivals(times, "trace", params, context_tokens=ctx, generated_tokens=gen)
