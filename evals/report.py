"""The sign-off report: Markdown for people, JSON for tools, a PNG plot for the release notes."""
from __future__ import annotations

import json
import math
from pathlib import Path

from evals.data import REPO_ROOT

COLLEAGUE_REPORTS = ("property-suite.json", "kill-table.json")
TABLE_HEAD = ("| configuration | n | accuracy (SE) | delta vs baseline [95% bootstrap CI] | b / c "
              "| McNemar p (Holm) | symmetry p (Holm) | TOST p [90% CI] | MDD / min margin | agreement "
              "| logprob drift mean / max | verdict |")
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
            return {"summary": obj["summary"]}
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
def markdown(rep: dict) -> str:
    g = rep["gate"]
    setup = (f"- matrix: `{rep['matrix']}`; data: `{rep['data_source']}`; subset seed {rep['seed']}; "
             f"margin +-{g['margin']} pts; alpha {g['alpha']} (Holm over {rep['n_tests']} rejection "
             f"tests); GSM8K metric `{g['gsm8k_metric']}`; lm-eval {rep['lm_eval_version']}")
    L = [f"# Accuracy-parity sign-off: **{rep['verdict']}**", "", setup,
         f"- baseline: `{rep['baseline']}`", ""]
    L += ["## Verdicts", "", "| configuration | layout | engine | verdict |", "| --- | --- | --- | --- |"]
    for c in rep["configs"]:
        L.append(f"| {c['name']} | {c['layout']} | {c['engine']} | {c.get('verdict') or 'baseline'} |")
    L += ["", "## Power before the run", "",
          "| task | n | MDD if 1% flip | 5% | 20% | smallest equivalence margin with 0 flips |",
          "| --- | --- | --- | --- | --- | --- |"]
    for r in rep["power"]:
        mdd = r["mdd"]
        L.append(f"| {r['task']} | {r['n']} | {_pts(mdd['1%'])} | {_pts(mdd['5%'])} | {_pts(mdd['20%'])} | "
                 f"{_pts(r['smallest_margin_zero_flips'])} |")
    L += ["", ("MDD: minimum detectable difference in accuracy points (power 0.8, alpha 0.05, two-sided), "
               "for an assumed fraction of items whose correctness flips between the configurations."), ""]
    for task in rep["tasks"]:
        rows = [c for c in rep["comparisons"] if c["task"] == task]
        L += [f"## {task}", "", TABLE_HEAD, "| --- " * 12 + "|"]
        base = next((c for c in rows), None)
        if base:
            L.append(f"| {base['baseline']} (baseline) | {base['n']} | {_pts(base['acc_base'])} "
                     f"({_pts(base['se_base'])}) | | | | | | | | | |")
        for c in rows:
            sym = c["symmetry"]
            drift = c["drift"]
            name = c["config"] + (" (A/A)" if c["kind"] == "aa" else "")
            L.append(
                f"| {name} | {c['n']} | {_pts(c['acc_cfg'])} ({_pts(c['se_cfg'])}) | {_pts(c['delta'])} "
                f"[{_pts(c['ci95_bootstrap'][0])}, {_pts(c['ci95_bootstrap'][1])}] | {c['b_base_only']} / "
                f"{c['c_cfg_only']} | {_p(c['p_mcnemar'])} ({_p(c['p_mcnemar_holm'])}) | "
                + (f"{_p(sym['p'])} ({_p(sym['p_holm'])})" if sym else "n/a")
                + f" | {_p(c['tost_p'])} [{_pts(c['ci_tost'][0])}, {_pts(c['ci_tost'][1])}] | "
                f"{_pts(c['mdd'])} / {_pts(c['equivalence_mdd'])} | {100 * c['agreement']:.1f}% | "
                + (f"{drift['mean_abs_chosen']:.3g} / {drift['max_abs_chosen']:.3g}" if drift else "n/a")
                + f" | {c['verdict']} |")
        L += ["", f"SE: {rows[0]['se_kind'] if rows else ''}; b = right only on the baseline, c = right only "
              "on the configuration; agreement: " + (rows[0]["agreement_what"] if rows else "") + ".", ""]
    L += ["## Why", ""]
    for c in rep["comparisons"]:
        tag = " (A/A)" if c["kind"] == "aa" else ""
        L.append(f"- **{c['config']}{tag} / {c['task']}: {c['verdict']}**")
        L += [f"  - {r}" for r in c["reasons"]]
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

    tasks = rep["tasks"]
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
