"""The markdown report of `jspec validate-gpu` (``jspec.validate_gpu``), from its JSON report:
a table of the stages, then per stage its checks, its main numbers and its errors. Every stage
may be partial (killed at its budget, or failed half way), so each table takes what is there."""

from __future__ import annotations

STATUS_WORD = {"pass": "pass", "fail": "FAIL", "error": "ERROR", "timeout": "TIMEOUT",
               "skipped": "skipped", "incomplete": "INCOMPLETE"}


def render(report: dict) -> str:
    dev = report["device"]
    lines = [f"# jspec validate-gpu: {STATUS_WORD.get(report['status'], report['status'])}", ""]
    if report["mode"] == "cpu":
        lines += ["**CPU run (`--allow-cpu`): every stage at tiny sizes with the kernels "
                  "interpreted. It checks this harness, not a GPU.**", ""]
    lines += [f"Device: {dev.get('device_count', '?')} x {dev.get('device_kind', '?')} "
              f"({dev.get('platform', '?')}); jax {dev.get('jax', '?')}, jaxlib "
              f"{dev.get('jaxlib', '?')}, Python {dev.get('python', '?')}. Created "
              f"{report['created']}; budget {report['budget_s']:.0f} s, used "
              f"{report['seconds']:.0f} s.", "",
              f"Command: `{report['command']}`", "",
              "| stage | status | seconds (budget) | summary |", "|---|---|---|---|"]
    for st in report["stages"]:
        lines.append(f"| {st['title']} | {STATUS_WORD.get(st['status'], st['status'])} | "
                     f"{st['seconds']:.0f} ({st['budget_s']:.0f}) | "
                     f"{_cell(st['summary'])} |")
    for st in report["stages"]:
        lines += ["", f"## {st['title']}", "",
                  f"Status: {STATUS_WORD.get(st['status'], st['status'])}. {st['summary']}", ""]
        if st["checks"]:
            for c in st["checks"]:
                mark = "x" if c["ok"] else " "
                kind = "" if c["required"] else " (goal, reported)"
                lines.append(f"- [{mark}] {c['name']}{kind}: {c['detail']}")
            lines.append("")
        lines += NUMBERS.get(st["name"], lambda n: [])(st["numbers"])
        if st["errors"]:
            lines += ["Errors:", "", "```", *[e.rstrip()[-3000:] for e in st["errors"]],
                      "```", ""]
        if st.get("log"):
            lines.append(f"Output: `{st['log']}`")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _kernel_tests(n: dict) -> list[str]:
    failures = n.get("failures") or []
    if not failures:
        return []
    lines = ["| failing test | kind | message |", "|---|---|---|"]
    lines += [f"| `{f['test']}` | {f['kind']} | {_cell(f['message'])} |" for f in failures]
    return lines + [""]


def _kernel_bench(n: dict) -> list[str]:
    res = n.get("bench_kernels")
    if not res:
        return []
    impls = [k for k in ("reference", "pallas", "interpret")
             if any(k in row for row in res["attention"] + res["migration"])]
    lines = [f"Attention, one layer, {res['dtype']}: ms / GB/s of KV read / fraction of the copy "
             f"bandwidth ({res['copy_bandwidth_gbps']:.0f} GB/s) / max error against the "
             "per-token oracle.", "",
             "| B | q | context | " + " | ".join(impls) + " |",
             "|---|---|---|" + "---|" * len(impls)]
    for row in res["attention"]:
        cells = [f"{row[k]['ms']:.3f} / {row[k]['gbps']:.0f} / {row[k]['roofline']:.0%} / "
                 f"{row[k]['max_abs_err']:.1e}" if k in row else "-" for k in impls]
        lines.append(f"| {row['batch']} | {row['q_len']} | {row['context']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "KV migration, K and V of every layer: ms / GB/s read + written / fraction of "
              "the copy bandwidth / bit-identical to a numpy copy.", "",
              "| blocks | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for row in res["migration"]:
        cells = [f"{row[k]['ms']:.3f} / {row[k]['gbps']:.0f} / {row[k]['roofline']:.0%} / "
                 f"{'yes' if row[k]['exact'] else 'NO'}" if k in row else "-" for k in impls]
        lines.append(f"| {row['blocks']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _greedy(n: dict) -> list[str]:
    runs = n.get("runs") or {}
    if not runs:
        return []
    lines = [f"{len(n['prompts'])} prompts, {n['max_tokens']} greedy tokens each, the built-in "
             "pair, γ = 4 (plain: policy off).", "",
             "| run | kernels | policy | acceptance | seconds (with compiling) |",
             "|---|---|---|---|---|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['kernel_backend']} | {run['policy']} | "
                     f"{run['acceptance_rate']:.3f} | {run['seconds']:.1f} |")
    return lines + [""]


def _serving(n: dict) -> list[str]:
    levels = n.get("levels") or []
    if not levels:
        return []
    acc = n.get("acceptance", {})
    lines = [f"SYNTHETIC: random-weight {n['shape']} shapes (target {n.get('target_model')}, "
             f"draft {n.get('draft_model')}), kernels {n.get('kernel_backend')}, acceptance "
             f"from {acc.get('source')} (expected accepted at γ = 4: "
             f"{acc.get('expected_accepted_at_gamma', {}).get('4', '?')}); "
             f"each level a batch of that many requests, {n['prompt_tokens']} prompt tokens at "
             f"most, {n['max_tokens']} output tokens.", "",
             f"Verdict: {n.get('verdict', '-')}", "",
             "| concurrency | policy | output tok/s | TPOT p50 ms | TPOT p90 ms | acceptance | "
             "mean γ |", "|---|---|---|---|---|---|---|"]
    for lv in levels:
        for r in lv["runs"]:
            lines.append(f"| {lv['concurrency']} | {r['label']} | {r['output_tokens_per_s']:.1f}"
                         f" | {_fmt(r['tpot_p50_s'], '.2f', 1e3)} | "
                         f"{_fmt(r['tpot_p90_s'], '.2f', 1e3)} | {r['acceptance_rate']:.3f} | "
                         f"{r['mean_gamma']:.2f} |")
        if "speedup" in lv:
            lines.append(f"| {lv['concurrency']} | **{lv['best_static']} / off** | "
                         f"**{lv['speedup']:.2f}x** | | | | |")
    return lines + [""]


NUMBERS = {"kernel-tests": _kernel_tests, "kernel-bench": _kernel_bench, "greedy": _greedy,
           "serving": _serving}
