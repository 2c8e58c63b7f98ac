"""Metric math of the serving benchmark, on recorded timelines (pure numpy, no engine).

All times are seconds on one clock whose zero is the benchmark's start (the moment arrival
offset 0 is due). Per request (``RequestRecord``):

* arrival: when the request was due (its scheduled arrival, not when the driver got round to
  sending it: an open-loop benchmark charges any lateness to the system);
* chunks: the streamed outputs, each with the time the client received it and how many new
  tokens it carried. Speculative steps deliver several tokens at once, so a token's time is its
  chunk's time;
* first token = the first chunk holding a token, finish = the last chunk.

Definitions (n = output tokens of the request):

* TTFT = first token − arrival; end-to-end latency (E2E) = finish − arrival;
* TPOT = (finish − first token) / (n − 1), defined for n ≥ 2 (requests with one token have no
  TPOT and are left out of its statistics; they meet any TPOT SLO);
* ITL = gaps between consecutive chunks of a request (what a streaming client waits between
  updates, as vLLM's benchmark reports it); with speculation a chunk holds 1 + accepted tokens;
* statistics: mean, p50, p90, p99 (numpy's linear-interpolation percentiles) over the requests
  (over all gaps for ITL);
* duration = the last finish time (the clock starts at 0), output tokens/s = total output
  tokens / duration, requests/s likewise;
* SLO attainment = share of finished requests with TPOT ≤ the TPOT SLO (and TTFT ≤ the TTFT SLO
  when one is given);
* goodput = requests meeting the SLOs per second of duration (vLLM's "request goodput");
  ``goodput_tokens_per_s`` = their output tokens per second;
* acceptance rate = accepted / drafted tokens, mean accepted length = (accepted + speculative
  steps) / speculative steps, summed over requests (the engine's ``spec_decode_*`` definitions).

Per turn of a conversation (``turn_metrics``, the multiturn workload; a record's ``turn`` is 1
for a conversation's first message): the same TTFT / TPOT / E2E statistics and the prompt
lengths over the finished requests of the first turn (``first``), of every later turn
(``later``, turn ≥ 2) and of each turn index (``turns``, keyed "1", "2", ...). A later turn's
arrival is when it became due: its previous turn's finish + the think time; its TTFT is what the
user waits after sending that message, the number prefix caching shortens.

Per category of prompt (``category_metrics``, for workloads of several, Spec-Bench's or mixed):
requests, output tokens, acceptance rate, mean accepted length and TPOT statistics over each
category's finished requests. The run's tokens/s is not split: the categories share its batches,
so a category's speed is its TPOT; its acceptance says which prompts speculation suits.

Time series (``time_series``) bin the run into windows of ``bin_seconds``: output tokens/s (by
chunk time), arrivals and completions per second, and from the engine steps recorded by the
driver (``StepRecords``): mean batch size, mean γ per decoding sequence, acceptance, steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestRecord:
    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    category: str = ""
    # multiturn: the conversation's id and the turn in it (1 = its first message), else None
    conversation_id: int | None = None
    turn: int | None = None
    submit: float | None = None  # when the driver handed it to the engine
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    num_spec_steps: int = 0
    num_steps: int = 0
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return int(sum(self.chunk_tokens))

    @property
    def first_token(self) -> float | None:
        for t, n in zip(self.chunk_times, self.chunk_tokens):
            if n > 0:
                return t
        return None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None

    def ttft(self) -> float | None:
        first = self.first_token
        return None if first is None else first - self.arrival

    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    def tpot(self) -> float | None:
        n, first = self.num_output_tokens, self.first_token
        if n < 2 or first is None or self.finish is None:
            return None
        return (self.finish - first) / (n - 1)

    def itls(self) -> list[float]:
        times = [t for t, n in zip(self.chunk_times, self.chunk_tokens) if n > 0]
        return [b - a for a, b in zip(times, times[1:])]

    def as_dict(self) -> dict:
        """JSON-ready; times rounded to the microsecond (a third of the digits of a full float,
        and long runs hold a time per chunk of every request)."""
        out = dataclasses.asdict(self)
        for key in ("arrival", "submit", "finish"):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        out["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        first = self.first_token
        out.update(num_output_tokens=self.num_output_tokens,
                   first_token=None if first is None else round(first, 6),
                   ttft=self.ttft(), tpot=self.tpot(), e2e=self.e2e())
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def summarize(values: Iterable[float]) -> dict:
    """count, mean, p50, p90, p99 (None when there are no values)."""
    arr = np.asarray([v for v in values if v is not None], float)
    out = {"count": int(arr.size), "mean": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def meets_slo(rec: RequestRecord, tpot_slo: float | None, ttft_slo: float | None) -> bool:
    if not rec.ok:
        return False
    if tpot_slo is not None:
        tpot = rec.tpot()
        if tpot is not None and tpot > tpot_slo:
            return False
    if ttft_slo is not None:
        ttft = rec.ttft()
        if ttft is None or ttft > ttft_slo:
            return False
    return True


def compute_metrics(records: Sequence[RequestRecord], *, tpot_slo: float | None = None,
                    ttft_slo: float | None = None, duration: float | None = None) -> dict:
    """The run's headline numbers (definitions in the module docstring). ``duration`` defaults
    to the last finish time."""
    done = [r for r in records if r.ok]
    if duration is None:
        duration = max((r.finish for r in done), default=0.0)
    tokens = sum(r.num_output_tokens for r in done)
    drafted = sum(r.num_drafted for r in done)
    accepted = sum(r.num_accepted for r in done)
    spec_steps = sum(r.num_spec_steps for r in done)
    good = [r for r in done if meets_slo(r, tpot_slo, ttft_slo)]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    itls = [g for r in done for g in r.itls()]
    chunk_sizes = [n for r in done for n in r.chunk_tokens if n > 0]
    return {
        "num_requests": len(records),
        "num_finished": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration,
        "total_output_tokens": tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens_per_s": per_s(tokens),
        "requests_per_s": per_s(len(done)),
        "tpot_slo_s": tpot_slo,
        "ttft_slo_s": ttft_slo,
        "slo_attainment": len(good) / len(done) if done else 0.0,
        "goodput_requests_per_s": per_s(len(good)),
        "goodput_tokens_per_s": per_s(sum(r.num_output_tokens for r in good)),
        "ttft_s": summarize(r.ttft() for r in done),
        "tpot_s": summarize(r.tpot() for r in done),
        "itl_s": summarize(itls),
        "e2e_s": summarize(r.e2e() for r in done),
        "tokens_per_chunk": float(np.mean(chunk_sizes)) if chunk_sizes else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + spec_steps) / spec_steps if spec_steps else 0.0,
        "num_drafted": drafted,
        "num_accepted": accepted,
        "num_spec_steps": spec_steps,
    }


def _group_metrics(records: Sequence[RequestRecord]) -> dict:
    done = [r for r in records if r.ok]
    return {"num_requests": len(records), "num_finished": len(done),
            "ttft_s": summarize(r.ttft() for r in done),
            "tpot_s": summarize(r.tpot() for r in done),
            "e2e_s": summarize(r.e2e() for r in done),
            "prompt_tokens": summarize(r.prompt_tokens for r in done)}


def turn_metrics(records: Sequence[RequestRecord]) -> dict:
    """Statistics by turn position (module docstring): {"first", "later", "turns": {"1", ...}}.
    Records without a turn (not from a conversation) are left out."""
    mine = [r for r in records if r.turn is not None]
    return {"first": _group_metrics([r for r in mine if r.turn == 1]),
            "later": _group_metrics([r for r in mine if r.turn >= 2]),
            "turns": {str(t): _group_metrics([r for r in mine if r.turn == t])
                      for t in sorted({r.turn for r in mine})}}


def category_metrics(records: Sequence[RequestRecord]) -> dict:
    """Statistics by prompt category (module docstring), keyed by category, sorted."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.category, []).append(r)
    return {c: _category_row(rs) for c, rs in sorted(groups.items())}


def _category_row(records: Sequence[RequestRecord]) -> dict:
    done = [r for r in records if r.ok]
    drafted = sum(r.num_drafted for r in done)
    accepted = sum(r.num_accepted for r in done)
    spec_steps = sum(r.num_spec_steps for r in done)
    return {"num_requests": len(records), "num_finished": len(done),
            "output_tokens": sum(r.num_output_tokens for r in done),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + spec_steps) / spec_steps if spec_steps else 0.0,
            "tpot_s": summarize(r.tpot() for r in done)}


STEP_FIELDS = ("time", "step_time", "draft_time", "catch_up_time", "batch_size", "num_decode",
               "gamma_sum", "gamma_max", "num_verified", "num_accepted", "num_emitted",
               "num_prefill_tokens", "num_tokens", "num_padded_tokens", "num_running",
               "num_waiting")
_SECONDS = ("time", "step_time", "draft_time", "catch_up_time")


@dataclasses.dataclass
class StepRecords:
    """Per engine step, columns (one entry per step that did work). ``time`` is the step's end
    on the benchmark clock; γ fields cover the decoding sequences (0 when none decoded)."""

    columns: dict[str, list] = dataclasses.field(
        default_factory=lambda: {name: [] for name in STEP_FIELDS})

    def append(self, **values) -> None:
        for name in STEP_FIELDS:
            self.columns[name].append(values[name])

    def __len__(self) -> int:
        return len(self.columns["time"])

    def as_dict(self) -> dict:
        return {k: [round(x, 6) for x in v] if k in _SECONDS else list(v)
                for k, v in self.columns.items()}


def _bin_index(times: np.ndarray, bin_seconds: float, num_bins: int) -> np.ndarray:
    return np.clip((times // bin_seconds).astype(np.int64), 0, num_bins - 1)


def time_series(records: Sequence[RequestRecord], steps: StepRecords | dict | None,
                bin_seconds: float, end: float | None = None) -> dict:
    """Binned series over [0, end): ``t`` is each bin's start. Bins with no decoding step have
    ``gamma_mean`` / ``acceptance`` None."""
    if not (bin_seconds > 0):
        raise ValueError(f"bin_seconds must be > 0, got {bin_seconds}")
    if end is None:
        end = max([r.finish for r in records if r.finish is not None] + [0.0])
    num_bins = max(1, math.ceil(end / bin_seconds - 1e-9))
    out_tokens = np.zeros(num_bins)
    arrivals = np.zeros(num_bins)
    finishes = np.zeros(num_bins)
    for r in records:
        if r.chunk_times:
            np.add.at(out_tokens, _bin_index(np.asarray(r.chunk_times), bin_seconds, num_bins),
                      np.asarray(r.chunk_tokens, float))
        arrivals[_bin_index(np.asarray([r.arrival]), bin_seconds, num_bins)] += 1
        if r.finish is not None:
            finishes[_bin_index(np.asarray([r.finish]), bin_seconds, num_bins)] += 1
    series = {"bin_seconds": bin_seconds,
              "t": [k * bin_seconds for k in range(num_bins)],
              "output_tokens_per_s": (out_tokens / bin_seconds).tolist(),
              "arrivals_per_s": (arrivals / bin_seconds).tolist(),
              "finished_per_s": (finishes / bin_seconds).tolist()}
    cols = steps.columns if isinstance(steps, StepRecords) else steps
    if cols and cols.get("time"):
        idx = _bin_index(np.asarray(cols["time"], float), bin_seconds, num_bins)

        def total(name):
            acc = np.zeros(num_bins)
            np.add.at(acc, idx, np.asarray(cols[name], float))
            return acc

        nsteps = np.bincount(idx, minlength=num_bins).astype(float)
        decode, gsum = total("num_decode"), total("gamma_sum")
        verified, accepted = total("num_verified"), total("num_accepted")
        batch = total("batch_size")
        series["steps"] = nsteps.astype(int).tolist()
        series["batch_size_mean"] = [b / n if n else None for b, n in zip(batch, nsteps)]
        series["gamma_mean"] = [g / d if d else None for g, d in zip(gsum, decode)]
        series["acceptance"] = [a / v if v else None for a, v in zip(accepted, verified)]
    return series


def gamma_by_batch(histograms: dict) -> dict:
    """{batch bucket: {"steps": sequence-steps, "mean_gamma", "histogram"}} from the engine's
    ``gamma_histogram_by_batch`` (bucket -> counts of γ = 0..Γmax over decoding sequences)."""
    out = {}
    for bucket, hist in sorted(histograms.items(), key=lambda kv: int(kv[0])):
        h = np.asarray(hist, float)
        n = h.sum()
        out[str(bucket)] = {"sequence_steps": int(n),
                            "mean_gamma": float((h * np.arange(len(h))).sum() / n) if n else None,
                            "histogram": [int(x) for x in h]}
    return out
