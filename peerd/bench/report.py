"""`peerd report RUN_DIR`: a `peerd bench scenarios` run directory made readable.

Writes, next to the data: per scenario a plot of accuracy and loss versus wall time per contender
(mean over the hosts of each host's newest value, the first seed whose files are there), a plot
of every host's iteration over time per contender (the iteration gap made visible), a heatmap of
the link matrix the daemons measured during the scenario (`peerd links --json`, each host's own
row), and report.md with the result table (medians over seeds; speedups are ratios of median
times to target).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of a results.jsonl (none if it does not exist); a torn last line (the run
    killed while writing it) is skipped, so the run it describes counts as not run."""
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs


def load(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta_path, results = run_dir / "meta.json", run_dir / "results.jsonl"
    if not meta_path.exists() or not results.exists():
        raise FileNotFoundError(f"{run_dir}: not a `peerd bench scenarios` run directory "
                                f"(meta.json and results.jsonl are missing)")
    return json.loads(meta_path.read_text()), load_records(results)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _ttt(r: dict[str, Any]) -> float:
    return math.inf if r.get("time_to_target_s") is None else r["time_to_target_s"]


def _fmt_s(x: float) -> str:
    return "missed" if math.isinf(x) else ("—" if math.isnan(x) else f"{x:.1f}s")


def _num(x: float, fmt: str) -> str:
    return "—" if math.isnan(x) else format(x, fmt)


def _ratio(base: float, ours: float) -> str:
    if math.isnan(base) or math.isnan(ours):
        return "—"
    if math.isinf(ours):
        return "missed"
    if math.isinf(base):
        return "base missed"
    return f"{base / ours:.2f}x"


# --- language-model runs (the gpt task, issue #35): validation loss and bits per byte -----------
LN2 = math.log(2.0)
BYTE_LEVEL_TASKS = ("gpt",)     # loss per byte: bits per byte = loss / ln 2


def lm_cell(rs: list[dict[str, Any]]) -> str:
    """'loss / bpb' of the averaged model (medians over seeds), for records that carry them."""
    loss = [r["final_eval_loss"] for r in rs if r.get("final_eval_loss") is not None]
    bpb = [r.get("final_bpb", r["final_eval_loss"] / LN2) for r in rs if r.get("final_eval_loss") is not None]
    base = [r["unigram_bpb"] for r in rs if r.get("unigram_bpb") is not None]
    if not loss:
        return "—"
    return f"{_median(loss):.3f} / {_median(bpb):.3f}" + (f" (unigram {_median(base):.2f})" if base else "")
# --- end of the language-model additions --------------------------------------------------------


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per (scenario, contender), medians over seeds."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        by.setdefault((r["scenario"], r["contender"]), []).append(r)
    med = {k: _median([_ttt(r) for r in v]) for k, v in by.items()}
    target = next((r["target"] for r in records if "target" in r), None)
    head = (f"| scenario | contender | time to {target:.0%} (median) | reached | vs DDP | vs D-PSGD | it/s per host "
            f"| idle | MB sent per step | final acc (avg model) |" if target is not None else "| scenario | contender |")
    lm = any(r.get("final_eval_loss") is not None for r in records)   # gpt runs: one more column
    if lm and target is not None:
        head += " final val loss / bpb (avg model) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (sc, c), rs in by.items():
        ok = [r for r in rs if "it_per_s" in r]     # measured, possibly until a failure
        failed = sum(1 for r in rs if "error" in r)
        reached = sum(1 for r in rs if r.get("reached_target"))
        if not ok:
            lines.append(f"| {sc} | {c} | failed: {rs[0]['error'][:60]} | 0/{len(rs)} | | | | | | |")
            continue
        m = med[(sc, c)]
        note = f" ({failed} run(s) failed, measured until then)" if failed else ""
        lines.append(
            f"| {sc} | {c} | {_fmt_s(m)}{note} | {reached}/{len(rs)} | {_ratio(med.get((sc, 'ddp'), math.nan), m)} "
            f"| {_ratio(med.get((sc, 'd-psgd'), math.nan), m)} | {_median([r['it_per_s'] for r in ok]):.2f} "
            f"| {_median([r['idle_fraction'] for r in ok]):.0%} | {_num(_median([r['bytes_per_step'] for r in ok if r.get('bytes_per_step') is not None]) / 1e6, '.2f')} "
            f"| {_num(_median([r['final_accuracy'] for r in ok if r.get('final_accuracy') is not None]), '.3f')} |"
            + (f" {lm_cell(ok)} |" if lm else ""))
    return "\n".join(lines) + "\n"


def matrix(records: list[dict[str, Any]]) -> str:
    """Markdown: scenarios x contenders, each cell the median time to target over seeds and its
    speedup over DDP (the README's table; `table` has the rest)."""
    scens = list(dict.fromkeys(r["scenario"] for r in records))
    conts = list(dict.fromkeys(r["contender"] for r in records))
    med = {}
    for sc in scens:
        for c in conts:
            rs = [r for r in records if r["scenario"] == sc and r["contender"] == c and "it_per_s" in r]
            if rs:
                med[(sc, c)] = (_median([_ttt(r) for r in rs]), len(rs))
    lines = ["| scenario | " + " | ".join(conts) + " |", "|---|" + "---|" * len(conts)]
    for sc in scens:
        base = med.get((sc, "ddp"), (math.nan, 0))[0]
        cells = []
        for c in conts:
            m, n = med.get((sc, c), (math.nan, 0))
            speed = "" if c == "ddp" or math.isinf(m) or math.isnan(m) else f" ({_ratio(base, m)})"
            cells.append("—" if not n else _fmt_s(m) + speed)
        lines.append(f"| {sc} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SPLIT = (("iteration", "iter_time_s"), ("step", "step_s"), ("compute", "compute_mean_s"), ("wait for mix", "wait_s"),
         ("mix itself", "mix_overhead_s"), ("other overhead", "other_s"), ("link busy", "transfer_s"))


def split_table(records: list[dict[str, Any]]) -> str:
    """Markdown: where each host's time goes (steady part, medians over seeds; records without the
    split are left out): seconds per iteration (skipped ones count), then per computed step:
    compute + wait + mix + other = step; the link's busy time overlaps the others. Last, the share
    of the host's TCP segments that were retransmissions (a shaped queue's drops)."""
    rows = [r for r in records if r.get("per_host") and all(v.get("wait_s") is not None for v in r["per_host"].values())]
    if not rows:
        return ""
    head = "| scenario | contender | host | " + " | ".join(name for name, _ in SPLIT) + " | TCP resent |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["scenario"], r["contender"]), []).append(r)
    for (sc, c), rs in by.items():
        for h in rs[0]["per_host"]:
            cells = []
            for _, key in SPLIT:
                vals = [r["per_host"][h].get(key) for r in rs if h in r["per_host"]]
                vals = [v for v in vals if v is not None]
                cells.append(f"{_median(vals):.3f}" if vals else "")
            resent = [r["per_host"][h].get("tcp_retransmitted") for r in rs if h in r["per_host"]]
            resent = [v for v in resent if v is not None]
            cells.append(f"{100 * _median(resent):.1f}%" if resent else "")
            lines.append(f"| {sc} | {c} | {h} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def _mean_latest(progress: dict[str, list[dict]], pick, missing: float | None = None) -> list[tuple[float, float]]:
    """Step function of the mean over hosts of each host's newest picked value (a host without
    one counts as `missing`; None: the function starts once every host has one)."""
    events = sorted((r["t"], h, v) for h, recs in progress.items() for r in recs
                    if (v := pick(r)) is not None)
    latest: dict[str, float] = {} if missing is None else dict.fromkeys(progress, missing)
    pts = []
    for t, h, v in events:
        latest[h] = v
        if len(latest) == len(progress):
            pts.append((t, sum(latest.values()) / len(latest)))
    return pts


def _run_data(run_dir: Path) -> tuple[float, dict[str, list[dict]], dict[str, list[dict]]] | None:
    hosts = sorted({p.name.split(".")[0] for p in run_dir.glob("h*.trace.jsonl")}, key=lambda h: int(h[1:]))
    traces = {h: _read_jsonl(run_dir / f"{h}.trace.jsonl") for h in hosts}
    progress = {h: _read_jsonl(run_dir / f"{h}.progress.jsonl") for h in hosts}
    if not hosts or not all(traces.values()):
        return None
    t0 = min(t[0]["start"] for t in traces.values())
    return t0, traces, progress


def plots(run_dir: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    target = meta["settings"]["target"]
    byte_level = meta["settings"].get("task") in BYTE_LEVEL_TASKS
    for sc in meta["scenarios"]:
        # each contender's first seed that has its files here (records copied from another run have none)
        seed_dirs = {c: min((d for d in (run_dir / sc / c).glob("seed*") if d.is_dir()),
                            key=lambda d: int(d.name[4:]) if d.name[4:].isdigit() else 1 << 30, default=None)
                     for c in meta["contenders"]}
        data = {c: d for c, sd in seed_dirs.items() if sd is not None and (d := _run_data(sd)) is not None}
        if not data:
            continue
        shown = sorted({seed_dirs[c].name[4:] for c in data})
        which = f"seed {shown[0]}" if len(shown) == 1 else f"first seed on file: {', '.join(shown)}"
        # accuracy and loss versus wall time
        fig, (ax_a, ax_l) = plt.subplots(1, 2, figsize=(12, 4.2))
        for c, (t0, _, progress) in data.items():
            acc = _mean_latest(progress, lambda r: r["metric"] if r.get("metric_name") == "accuracy" else None,
                               missing=0.0)   # as time to target counts it
            loss = _mean_latest(progress, lambda r: r["loss"] if r.get("state") == "training" and r.get("loss", 0) > 0
                                else None)
            if byte_level:   # gpt: the hosts' validation bits per byte in place of accuracy
                acc = _mean_latest(progress, lambda r: r["metric"] / LN2 if r.get("metric_name") == "loss" else None)
            if acc:
                ax_a.step([t - t0 for t, _ in acc], [v for _, v in acc], where="post", label=c, lw=1.4)
            if loss:
                ax_l.plot([t - t0 for t, _ in loss], [v for _, v in loss], label=c, lw=1.1)
        # the x range ends where the last host's last step does (a hung run's progress repeats after)
        end = max(max(tr[-1]["t"] for tr in traces.values()) - t0 for t0, traces, _ in data.values())
        for ax in (ax_a, ax_l):
            ax.set_xlim(0, end * 1.03)
        if byte_level:
            ax_a.set(xlabel="wall time (s)", ylabel="mean validation bits per byte of the hosts' models",
                     title=f"{sc}: validation bits per byte vs wall time ({which})")
        else:
            ax_a.axhline(target, color="grey", ls=":", lw=1)
            ax_a.set(xlabel="wall time (s)", ylabel="mean test accuracy of the hosts' models",
                     title=f"{sc}: accuracy vs wall time ({which})")
        ax_l.set(xlabel="wall time (s)", ylabel="mean training loss", yscale="log",
                 title=f"{sc}: training loss vs wall time")
        for ax in (ax_a, ax_l):
            ax.grid(alpha=0.3)
        ax_a.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, run_dir / f"{sc}-accuracy.png"))
        plt.close(fig)
        # iteration progress of each host
        cols = min(4, len(data))
        rows = math.ceil(len(data) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3 * rows), squeeze=False, sharey=True)
        for ax, (c, (t0, traces, _)) in zip(axes.flat, data.items()):
            for h, tr in traces.items():
                ax.plot([r["t"] - t0 for r in tr], [r["it"] for r in tr], lw=1, label=h)
            ax.set_title(c, fontsize=10)
            ax.set_xlabel("wall time (s)")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(data):]:
            ax.axis("off")
        axes[0][0].set_ylabel("iteration")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{sc}: iteration of every host over time ({which})")
        fig.tight_layout()
        written.append(_save(fig, run_dir / f"{sc}-progress.png"))
        plt.close(fig)
        heat = _link_heatmap(run_dir / sc, plt)
        if heat is not None:
            written.append(heat)
    return written


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=80)
    return path


def _link_heatmap(sc_dir: Path, plt) -> Path | None:
    links_path, hosts_path = sc_dir / "links.json", sc_dir / "hosts.json"
    if not links_path.exists() or not hosts_path.exists():
        return None
    hosts = json.loads(hosts_path.read_text())
    names = sorted(hosts, key=lambda h: int(h[1:]))
    by_id = {v["node_id"]: h for h, v in hosts.items()}
    n = len(names)
    mat = [[math.nan] * n for _ in range(n)]
    for h, view in json.loads(links_path.read_text()).items():
        for row in (view or {}).get("links", []):
            src, dst = by_id.get(row["measurer"]), by_id.get(row["target"])
            if src == h and dst and row.get("mbit_s", 0) > 0:   # each host's own measurements
                mat[names.index(src)][names.index(dst)] = row["mbit_s"]
    measured = any(not math.isnan(v) for row in mat for v in row)
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(mat, cmap="viridis", norm=plt.matplotlib.colors.LogNorm() if measured else None)
    for i in range(n):
        for j in range(n):
            if not math.isnan(mat[i][j]):
                ax.text(j, i, f"{mat[i][j]:.0f}", ha="center", va="center", color="w", fontsize=8)
    ax.set_xticks(range(n), names)
    ax.set_yticks(range(n), names)
    ax.set(xlabel="to", ylabel="measured by",
           title=f"{sc_dir.name}: measured Mbit/s" + ("" if measured else " (none captured)"))
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    out = _save(fig, sc_dir.parent / f"{sc_dir.name}-links.png")
    plt.close(fig)
    return out


def other_settings(records: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """A merged run directory's runs made with other iterations or budget than its settings."""
    other = sorted({(r["scenario"], r["contender"], r["iterations"], r.get("budget", "host")) for r in records
                    if r["iterations"] != settings["iterations"]
                    or r.get("budget", "host") != settings.get("async_budget", "host")})
    if not other:
        return ""
    return "Runs with other settings: " + "; ".join(
        f"{sc} / {c}: {its} iterations, {'the swarm' if b == 'swarm' else 'each host'}'s budget"
        for sc, c, its, b in other) + "."


def write(run_dir: Path) -> Path:
    """report.md with the table and every plot; returns its path."""
    meta, records = load(run_dir)
    st = meta["settings"]
    pngs = plots(run_dir, meta, records)
    steps = [r for r in records if "step_time_mean" in r]
    body = [f"# peerd bench scenarios: {run_dir.name}", "",
            f"Task {st['task']} ({meta['model_bytes'] / 1e6:.2f} MB of parameters per model), {st['iterations']} "
            f"iterations, emulated compute {st['step_time']:g} s per step x slowdown, topology {st['topology']}"
            f"{', non-iid (label-sorted) shards' if st.get('non_iid') else ''}, "
            f"target accuracy {st['target']:.0%}, {meta['seeds']} seed(s).", ""]
    for sc in meta["scenarios"]:
        body.append(f"- **{sc}**: {meta['descriptions'].get(sc, '')}")
    other = other_settings(records, st)
    if other:
        body += ["", other]
    body += ["", "Median time to the target and speedup over DDP:", "", matrix(records),
             "Per contender (medians over seeds):", "", table(records)]
    if steps:
        body.append(f"Measured compute per step: mean {statistics.mean(r['step_time_mean'] for r in steps):.3f} s.")
    split = split_table(records)
    if split:
        body += ["", "Where the time goes (seconds per host, steady part: per iteration, then per computed "
                 "step; compute from the trainer's trace, wait = time in the mix call above the run's "
                 "mix floor, link busy = bytes sent per step / the host's egress rate):", "", split]
    body.append("")
    body += [f"![{p.stem}]({p.name})" for p in pngs]
    out = run_dir / "report.md"
    out.write_text("\n".join(body) + "\n")
    return out
