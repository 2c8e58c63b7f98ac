"""Figures of serving-benchmark results (PNG, matplotlib's Agg backend), and `jspec bench plot`.

    jspec bench plot low.json medium.json high.json trace.json --out plots/

For each results file (written by `jspec bench serving --out`):

* ``NAME_throughput.png``: output tokens/s over time, one line per policy, with the arrival
  rate behind them (like Nightjar's Fig. 11 on a trace);
* ``NAME_gamma_batch.png``: per policy, the batch size and the mean γ chosen per decoding
  sequence over time (like AdaSpec's Fig. 13); per-step points where the file has step records;

and over all files, ``summary.png``: policy × load, one group per file (its arrival label):
output tokens/s, p90 TPOT and SLO attainment.

matplotlib is in the ``bench`` extra (``pip install 'jspec[bench]'``); it is imported only
when a figure is drawn.
"""

from __future__ import annotations

import argparse
import os

from jspec.bench.serving_metrics import RequestRecord, time_series
from jspec.jsonfile import read_json


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend, or a ValueError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'jspec[bench]' (or matplotlib)"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_results(path: str) -> dict:
    from jspec.bench.serving import FORMAT

    data = read_json(path, "results")
    if not isinstance(data, dict) or data.get("format") != FORMAT or not data.get("runs"):
        raise ValueError(f"{path!r} is not a `jspec bench serving` results file ({FORMAT})")
    return data


def _series(run: dict, bin_seconds: float | None) -> dict:
    """The run's stored time series, or one rebinned from its records."""
    if bin_seconds is None or "requests" not in run:
        return run["time_series"]
    records = [RequestRecord.from_dict(r) for r in run["requests"]]
    return time_series(records, run.get("steps"), bin_seconds)


def _edges(series: dict, values: list) -> tuple[list, list]:
    """Bin starts plus the last bin's end, values with the last repeated: ``steps-post`` then
    draws every bin at its full width, the last one included."""
    t = list(series["t"][:len(values)])
    if not t:
        return t, list(values)
    return t + [t[-1] + series["bin_seconds"]], list(values) + [values[-1]]


def _synthetic_tag(results: dict) -> str:
    return "SYNTHETIC acceptance, " if results.get("synthetic") else ""


def _title(results: dict) -> str:
    return (f"{_synthetic_tag(results)}{results['arrivals']['label']}, "
            f"{results['workload']['name']} prompts")


def plot_throughput(results: dict, path: str, bin_seconds: float | None = None) -> str:
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rate_ax = ax.twinx()
    arrivals_drawn = False
    for run in results["runs"]:
        s = _series(run, bin_seconds)
        ax.plot(*_edges(s, s["output_tokens_per_s"]), label=run["label"],
                drawstyle="steps-post", linewidth=1.4)
        if not arrivals_drawn:  # identical for every run: same requests, same times
            rate_ax.fill_between(*_edges(s, s["arrivals_per_s"]), step="post", color="0.85",
                                 zorder=0, label="arrivals")
            arrivals_drawn = True
    ax.set_zorder(rate_ax.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    rate_ax.set_ylabel("arrivals (requests/s)", color="0.45")
    ax.set_ylim(bottom=0)
    rate_ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"Throughput over time: {_title(results)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gamma_batch(results: dict, path: str, bin_seconds: float | None = None) -> str:
    plt = require_matplotlib()
    runs = results["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        s = _series(run, bin_seconds)
        gamma_ax = ax.twinx()
        batch = [b if b is not None else float("nan") for b in s.get("batch_size_mean", [])]
        gamma = [g if g is not None else float("nan") for g in s.get("gamma_mean", [])]
        steps = run.get("steps")
        if steps and steps.get("time"):
            per_step = [(t, g / n) for t, g, n in zip(steps["time"], steps["gamma_sum"],
                                                       steps["num_decode"]) if n]
            if per_step:
                gamma_ax.scatter(*zip(*per_step), s=3, color="tab:orange", alpha=0.25,
                                 linewidths=0)
        if batch:
            ax.plot(*_edges(s, batch), color="tab:blue", drawstyle="steps-post",
                    label="batch size")
        if gamma:
            gamma_ax.plot(*_edges(s, gamma), color="tab:orange", drawstyle="steps-post",
                          label="mean γ")
        ax.set_ylabel("batch size", color="tab:blue")
        gamma_ax.set_ylabel("γ", color="tab:orange")
        ax.set_ylim(bottom=0)
        # the whole 0..Γmax range, so a policy that never speculates reads as a flat zero
        gamma_max = results["config"].get("num_speculative_tokens") or 1
        gamma_ax.set_ylim(0, max(gamma_max, 1) + 0.3)
        ax.set_title(run["label"], fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(f"Batch size and chosen γ over time: {_title(results)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_summary(results_list: list[dict], path: str) -> str:
    """Policy × load: grouped bars, one group per results file."""
    import numpy as np

    plt = require_matplotlib()
    loads = [r["arrivals"]["label"] for r in results_list]
    from jspec.bench.serving import policy_rows

    labels: list[str] = []
    for r in results_list:
        for run in policy_rows(r):
            if run["label"] not in labels:
                labels.append(run["label"])

    def vs_best_fixed(results: dict, run: dict):
        row = next((c for c in results.get("comparison", []) if c["label"] == run["label"]),
                   None)
        return row["vs_best_fixed"] if row else None

    panels = (("output tokens/s", lambda r, u: u["metrics"]["output_tokens_per_s"], 1.0),
              ("throughput / best of off and static", vs_best_fixed, 1.0),
              ("p90 TPOT (ms)", lambda r, u: u["metrics"]["tpot_s"]["p90"], 1e3))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    x = np.arange(len(loads))
    width = 0.8 / max(len(labels), 1)
    for ax, (name, get, scale) in zip(axes[0], panels):
        for j, label in enumerate(labels):
            values = []
            for r in results_list:
                run = next((u for u in policy_rows(r) if u["label"] == label), None)
                v = get(r, run) if run is not None else None
                values.append(np.nan if v is None else v * scale)
            ax.bar(x + (j - (len(labels) - 1) / 2) * width, values, width, label=label)
        ax.set_xticks(x)
        ax.set_xticklabels(loads, rotation=20, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        if name.startswith("throughput /"):
            ax.axhline(1.0, color="black", linewidth=0.8)
    axes[0, 0].legend(fontsize=7)
    synthetic = any(r.get("synthetic") for r in results_list)
    fig.suptitle(("SYNTHETIC acceptance: " if synthetic else "") + "Policies × load",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def chain_shares(results: dict) -> dict[str, dict[str, float]]:
    """Per run of a chain-choosing policy (``specrouter``, or any run that drafted with two
    chains or more), the share of its decoding steps per chain of models
    (EngineMetrics.chain_histogram; "target" = the steps that drafted nothing)."""
    from jspec.bench.serving import policy_rows

    out = {}
    for run in policy_rows(results):
        hist = run.get("engine_metrics", {}).get("chain_histogram") or {}
        total = sum(hist.values())
        drafting = [c for c in hist if c != "target"]
        if total and (run.get("policy") == "specrouter" or len(drafting) > 1):
            out[run["label"]] = {c: n / total for c, n in sorted(hist.items())}
    return out


def plot_chains(results_list: list[dict], path: str) -> str | None:
    """The chains an adaptive chain policy (SpecRouter) played at each load: one stacked bar per
    (load, run), the share of its decoding steps per chain. None when no run switched chains."""
    import numpy as np

    per_load = [(r["arrivals"]["label"], chain_shares(r)) for r in results_list]
    bars = [(f"{load}\n{label}" if len(shares) > 1 else load, share)
            for load, shares in per_load for label, share in shares.items()]
    if not bars:
        return None
    plt = require_matplotlib()
    chains = sorted({c for _, share in bars for c in share}, key=lambda c: (c.count(">"), c))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(bars) + 2), 4.2))
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for chain in chains:
        values = np.array([share.get(chain, 0.0) for _, share in bars])
        ax.bar(x, values, 0.6, bottom=bottom, label=chain)
        bottom += values
    ax.set_xticks(x)
    ax.set_xticklabels([name for name, _ in bars], fontsize=8)
    ax.set_ylabel("share of decoding steps")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Chains chosen per load", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(results_list: list[dict], out_dir: str, names: list[str] | None = None,
                 bin_seconds: float | None = None) -> list[str]:
    """Every figure for these results into ``out_dir``; returns the paths written."""
    require_matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    names = names or [f"run{i}" for i in range(len(results_list))]
    paths = []
    for name, results in zip(names, results_list):
        paths.append(plot_throughput(results, os.path.join(out_dir, f"{name}_throughput.png"),
                                     bin_seconds))
        paths.append(plot_gamma_batch(results, os.path.join(out_dir, f"{name}_gamma_batch.png"),
                                      bin_seconds))
    paths.append(plot_summary(results_list, os.path.join(out_dir, "summary.png")))
    chains = plot_chains(results_list, os.path.join(out_dir, "chains.png"))
    if chains is not None:
        paths.append(chains)
    return paths


# ----------------------------------------------------------------------------- `jspec bench plot`
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS.json",
                   help="files written by `jspec bench serving --out`")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the PNG files")
    p.add_argument("--bin-seconds", type=float, default=None,
                   help="rebin the time series (needs per-request records in the files)")


def run(args: argparse.Namespace) -> int:
    if args.bin_seconds is not None and not args.bin_seconds > 0:
        raise ValueError(f"--bin-seconds must be > 0, got {args.bin_seconds}")
    require_matplotlib()
    results = [load_results(p) for p in args.results]
    names, seen = [], {}
    for p in args.results:
        stem = os.path.splitext(os.path.basename(p))[0]
        seen[stem] = seen.get(stem, 0) + 1
        names.append(stem if seen[stem] == 1 else f"{stem}_{seen[stem]}")
    for path in plot_results(results, args.out, names, args.bin_seconds):
        print(f"wrote {path}")
    return 0
