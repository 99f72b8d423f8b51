"""The sign-off report: Markdown for people, JSON for tools, a PNG plot for the release notes."""
from __future__ import annotations

import json
import math
from pathlib import Path

from dpep_parity.evals import tasks
from dpep_parity.evals.data import REPO_ROOT

COLLEAGUE_REPORTS = ("property-suite.json", "kill-table.json")
TABLE_HEAD = ("| configuration | n | accuracy (SE) | delta vs baseline [95% bootstrap CI] | b / c "
              "| difference test p (Holm) | symmetry p (Holm) | exact 90% interval | cluster-robust 90% interval "
              "| MDD (Holm) | agreement | logprob drift mean / max | verdict |")
TABLE_COLS = 13
VERDICT_COLORS = {"PASS": "tab:green", "INCONCLUSIVE": "tab:orange", "FAIL": "tab:red"}


def _pts(x, nd=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{nd}f}"


def _p(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


# ---------------------------------------------------------------------------------- colleagues' reports
def _summarize(obj) -> dict:
    """A short, schema-agnostic summary of another tool's JSON report."""
    if isinstance(obj, dict):
        if isinstance(obj.get("summary"), dict | str):
            return {"summary": obj["summary"], **_failed_properties(obj)}
        out = {k: (v[:117] + "..." if isinstance(v, str) and len(v) > 120 else v) for k, v in obj.items()
               if isinstance(v, str | int | float | bool) or v is None}
        out.update({f"{k} (entries)": len(v) for k, v in obj.items() if isinstance(v, list | dict)})
        return dict(list(out.items())[:20])
    if isinstance(obj, list):
        out: dict = {"entries": len(obj)}
        for key in ("verdict", "status", "killed", "outcome", "result"):
            vals = [str(x.get(key)) for x in obj if isinstance(x, dict) and key in x]
            if vals:
                out[f"by {key}"] = {v: vals.count(v) for v in sorted(set(vals))}
        return out
    return {"value": obj}


def _failed_properties(obj: dict) -> dict:
    """The property suite's failure records (checks.core.records, in reports/property-suite.json) counted per failed
    property: read from the records, not from their text; a record of an unknown version is named, not read."""
    from dpep_parity.checks.core.records import FailureRecord, RecordError
    counts: dict[str, int] = {}
    unread = 0
    for failure in obj.get("failures") or ():
        for raw in failure.get("records") or ():
            try:
                rec = FailureRecord.from_json(json.dumps(raw))
            except RecordError:
                unread += 1
                continue
            for prop in rec.properties:
                counts[prop] = counts.get(prop, 0) + 1
    out = {"failed properties": counts} if counts else {}
    return out | ({"unreadable failure records": unread} if unread else {})


def find_colleague_reports(out_dir: Path) -> dict[str, dict]:
    found = {}
    for name in COLLEAGUE_REPORTS:
        for root in (Path(out_dir) / "reports", REPO_ROOT / "reports"):
            f = root / name
            if f.is_file():
                try:
                    found[name] = {"path": str(f), "summary": _summarize(json.loads(f.read_text()))}
                except (OSError, ValueError) as e:
                    found[name] = {"path": str(f), "summary": {"error": f"unreadable: {e}"}}
                break
    return found


# ---------------------------------------------------------------------------------- markdown
def _margins(g: dict, measures) -> str:
    m = g["margin"]
    return ", ".join(f"{t} +-{m[t] if isinstance(m, dict) else m} pts" for t in measures)


def markdown(rep: dict) -> str:
    g = rep["gate"]
    setup = (f"- matrix: `{rep['matrix']}`; data: `{rep['data_source']}`; subset seed {rep['seed']}; "
             f"margins {_margins(g, rep['measures'])}; alpha {g['alpha']} (Holm over {rep['n_tests']} tests); "
             f"GSM8K metric `{g['gsm8k_metric']}`; lm-eval {rep['lm_eval_version']}")
    L = [f"# Accuracy-parity sign-off: **{rep['verdict']}** (exit code {rep.get('exit_code', '?')})", "", setup,
         f"- baseline: `{rep['baseline']}`", ""]
    L += ["## Verdicts", "", "| configuration | layout | engine | dtype | verdict |", "| --- | --- | --- | --- | --- |"]
    for c in rep["configs"]:
        L.append(f"| {c['name']} | {c['layout']} | {c['engine']} {c.get('target') or ''} | {c['dtype']} | "
                 f"{c.get('verdict') or c.get('role') or 'baseline'} |")
    served = [c for c in rep["configs"] if c.get("serving")]
    if served:
        L += ["", "## What the engines ran", "",
              "| configuration | steps | with a prefill | with a decode | prefill + decode | with an idle DP rank "
              "| MAX_LEN padded | tokens |", "| --- " * 8 + "|"]
        for c in served:
            st = c["serving"]
            L.append(f"| {c['name']} | {st.get('steps', 0)} | {st.get('extend_steps', 0)} | "
                     f"{st.get('decode_steps', 0)} | {st.get('mixed_steps', 0)} | {st.get('idle_rank_steps', 0)} | "
                     f"{st.get('max_len_steps', 0)} | {st.get('tokens', 0)} |")
        L += ["", ("Steps of the in-process serving engine (checks.serving), over every task and every run that "
                   "filled the cache: each step is one forward of the whole world; 'with an idle DP rank' counts "
                   "steps where some DP rank had nothing to run while others did, 'MAX_LEN padded' the steps "
                   "whose DP gather padded every rank to the largest count (as the target reported it).")]
    L += ["", "## Sample sizes planned before the run", "",
          "| task | n | margin | n for PASS, 0% flips | 1% flips | 5% flips | MDD (Holm) at 1% flips | 5% |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["plan"]:
        need = r["n_needed"]
        L.append(f"| {r['task']} | {r['n']} | +-{_pts(r['margin'])} | {need['0%'] or '> 200000'} | "
                 f"{need['1%'] or '> 200000'} | {need['5%'] or '> 200000'} | {_pts(r['mdd']['1%'])} | "
                 f"{_pts(r['mdd']['5%'])} |")
    L += ["", ("n for PASS: items whose exact equivalence interval lies within the margin with probability "
               f"{g['power']} when the systems are equivalent and that fraction of items flips (half each way). "
               f"MDD: the difference the difference test detects with power {g['power']} at alpha / "
               f"{rep['plan'][0]['family'] if rep['plan'] else 1} (Holm's first step)."), ""]
    for task in rep["measures"]:
        rows = [c for c in rep["comparisons"] if c["task"] == task]
        unit = rows[0]["unit"] if rows else "item"
        title = tasks.measures()[task].title if task in tasks.measures() else ""
        L += [f"## {task}" + (f" ({title})" if title else ""),
              "", TABLE_HEAD, "| --- " * TABLE_COLS + "|"]
        base = next((c for c in rows), None)
        if base:
            L.append(f"| {base['baseline']} (baseline) | {base['n']} | {_pts(base['acc_base'])} "
                     f"({_pts(base['se_base'])}) |" + " |" * (TABLE_COLS - 3))
        for c in rows:
            sym = c["symmetry"]
            drift = c["drift"]
            eq = c["equivalence"]
            name = c["config"] + (" (A/A)" if c["kind"] == "aa" else "")
            L.append(
                f"| {name} | {c['n']} | {_pts(c['acc_cfg'])} ({_pts(c['se_cfg'])}) | {_pts(c['delta'])} "
                f"[{_pts(c['ci95_bootstrap'][0])}, {_pts(c['ci95_bootstrap'][1])}] | {c['b_base_only']} / "
                f"{c['c_cfg_only']} | {_p(c['p_diff'])} ({_p(c['p_diff_holm'])}) | "
                + (f"{_p(sym['p'])} ({_p(sym['p_holm'])})" if sym else "n/a")
                + f" | [{_pts(eq['exact'][0])}, {_pts(eq['exact'][1])}] | [{_pts(eq['t'][0])}, {_pts(eq['t'][1])}] | "
                f"{_pts(c['mdd'])} | {100 * c['agreement']:.1f}% | "
                + (f"{drift['mean_abs_chosen']:.3g} / {drift['max_abs_chosen']:.3g}" if drift else "n/a")
                + f" | {c['verdict']} |")
        L += ["", f"Units: {unit}s; SE: {rows[0]['se_kind'] if rows else ''}; b = right only on the baseline, "
              "c = right only on the configuration; difference test: " + (rows[0]["diff_test"] if rows else "")
              + "; agreement: " + (rows[0]["agreement_what"] if rows else "") + ".", ""]
        tested = [c for c in rows if c.get("error")]
        if tested:
            L += [f"### {task}: the tolerance test against the float64 truth", "",
                  "| configuration | mean error, baseline (nats) | mean error, configuration | ratio (bound) "
                  "| worst document | p (Holm) | tail: configuration / baseline tokens (of) | tail document "
                  "| tail p (Holm) | tokens beyond 2x the baseline's largest (information) |",
                  "| --- " * 10 + "|"]
            for c in tested:
                e = c["error"]
                t = e["tail"]
                name = c["config"] + (" (A/A)" if c["kind"] == "aa" else "")
                L.append(f"| {name} | {e['err_base']:.3g} | {e['err_cfg']:.3g} | {e['ratio']:.2f}x "
                         f"({e['factor']:g}x) | {e['worst_doc'] or '-'} | {_p(e['p'])} ({_p(e.get('p_holm'))}) | "
                         f"{t['cfg_tokens']} / {t['base_tokens']} ({t['size']}) | {t['worst_doc'] or '-'} | "
                         f"{_p(t['p'])} ({_p(t.get('p_holm'))}) | {e['beyond']} |")
            L += ["", ("Error: |log-probability of each reference token - the float64 truth run's|, the truth "
                       "being the baseline served in float64. The tolerance model (checks/core/numerics.py) lets a "
                       "layout err at most its factor times what the baseline errs in the same dtype: pooled, "
                       f"{tested[0]['error']['method']} of the documents' summed excess; in the tail, "
                       f"{tested[0]['error']['tail']['method']}: of the largest errors of both runs (the "
                       "configuration's divided by the factor), how many are the configuration's, at the tail "
                       "size where that share is most significant. Tokens beyond 2x the baseline's largest error "
                       "are counted, not judged: each run resolves some router near-ties on its own."), ""]
    L += ["## Why", ""]
    for c in rep["comparisons"]:
        tag = " (A/A)" if c["kind"] == "aa" else ""
        L.append(f"- **{c['config']}{tag} / {c['task']}: {c['verdict']}**")
        L += [f"  - {r}" for r in c["reasons"]]
    if rep.get("served_drift"):
        L += ["", "## Served drift (same prompts, other arrival order, dispatch, concurrency)", "",
              "Six prompts served as above and under four other schedules, prompt logits and teacher-forced "
              "log-probabilities compared bit for bit (checks/serving/invariance.py). Information unless the "
              "target promises batch and placement invariance; then any difference FAILs its configuration.", ""]
        for d in rep["served_drift"]:
            head = f"- **{d['config']}** ({'promises invariance' if d['promised'] else 'promises none'})"
            L += [f"{head}: probe failed: {d['error']}"] if "error" in d else [head] + [f"  - {x}" for x in d["lines"]]
    if rep.get("aa"):
        L += ["", "## A/A (baseline run twice)", ""] + [f"- {n}" for n in rep["aa"]]
    if rep.get("findings"):
        L += ["", "## Findings", ""] + [f"- {n}" for n in rep["findings"]]
    if rep.get("colleague_reports"):
        L += ["", "## Other reports", ""]
        for name, info in rep["colleague_reports"].items():
            L.append(f"- `{name}` ({info['path']}):")
            L += [f"  - {k}: {v}" for k, v in info["summary"].items()]
    L += ["", f"Plot: `{Path(rep['files']['png']).name}`", ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------- plot
def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = rep["measures"]
    fig, axes = plt.subplots(2, max(1, len(tasks)), figsize=(5.5 * max(1, len(tasks)), 7), squeeze=False)
    for k, task in enumerate(tasks):
        rows = [c for c in rep["comparisons"] if c["task"] == task]
        if not rows:
            continue
        names = [rows[0]["baseline"]] + [c["config"] + (" A/A" if c["kind"] == "aa" else "") for c in rows]
        accs = [rows[0]["acc_base"]] + [c["acc_cfg"] for c in rows]
        ses = [rows[0]["se_base"]] + [c["se_cfg"] for c in rows]
        ax = axes[0][k]
        xs = range(len(names))
        colors = ["gray"] + [VERDICT_COLORS.get(c["verdict"], "black") for c in rows]
        for x, a, s, col in zip(xs, accs, ses, colors):
            ax.errorbar([x], [100 * a], yerr=[0 if math.isnan(s) else 196 * s], fmt="o", capsize=4, color=col)
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("accuracy (%) +- 95% CI (color: verdict)")
        ax.set_title(f"{task} (n={rows[0]['n']})")
        ax2 = axes[1][k]
        if not any(c["b_base_only"] or c["c_cfg_only"] for c in rows):
            ax2.set_axis_off()          # an empty bar chart reads as a broken plot: say what it means
            agree = min(c["agreement"] for c in rows)
            ax2.text(0.5, 0.5, f"no discordant items:\nevery configuration is right on exactly the items\n"
                     f"the baseline is right on ({rows[0]['n']} items)\nanswer agreement >= {100 * agree:.1f}%",
                     ha="center", va="center", fontsize=10, transform=ax2.transAxes)
            continue
        xs2 = range(len(rows))
        ax2.bar([x - 0.2 for x in xs2], [c["b_base_only"] for c in rows], width=0.4,
                label="right only on baseline")
        ax2.bar([x + 0.2 for x in xs2], [c["c_cfg_only"] for c in rows], width=0.4,
                label="right only on config")
        ax2.set_xticks(list(xs2), names[1:], rotation=30, ha="right", fontsize=8)
        ax2.set_ylabel("discordant items")
        ax2.legend(fontsize=7)
    fig.suptitle(f"accuracy parity: {rep['verdict']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(rep: dict, out_dir: Path) -> dict[str, str]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"markdown": str(out_dir / "signoff.md"), "json": str(out_dir / "signoff.json"),
             "png": str(out_dir / "signoff.png")}
    rep["files"] = files
    plot(rep, Path(files["png"]))
    Path(files["markdown"]).write_text(markdown(rep))
    Path(files["json"]).write_text(json.dumps(rep, indent=1, default=str))
    return files
