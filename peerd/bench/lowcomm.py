"""`peerd bench lowcomm`: the low-communication mode against today's algorithms on the two-sites lab
with the 25M-parameter byte-level GPT (issue 29).

Every contender trains the `gpt` task (model size small, 25.5M parameters, 101.7 MB in float32)
from one shared warm start (`--init`) on the lab's hosts, with the same batch and the same paced
step time (`--step-time`: every inner step takes that long whatever the load of this machine, the
compute of a GPU emulated). Recorded per run: each host's evaluations (validation loss, nats per
byte), the time until the hosts' mean validation loss first reaches the target, the final loss,
the inner steps each host took, and the bytes each host's interface sent (TxSampler), so bytes per
inner step. A contender is a name and its `peerd train` flags (CONTENDERS); `--straggler HOST`
makes that host 2x slower in the straggler contenders.

Every run is a record in OUT/results.jsonl; `table(records)` is the Markdown table of docs/bench.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from peerd.bench.scenarios import TxSampler, _prepare_lab, _py, _read_jsonl, _wait_all, code_version
from peerd.config import Config
from peerd.lab import lab, profile


@dataclass
class LowCommSettings:
    init: str = ""                 # the shared warm start (a state_dict of the small model)
    model_size: str = "small"
    context: int = 128
    batch_size: int = 2
    eval_tokens: int = 2048
    step_time: float = 2.5         # paced seconds per inner step (4 trainers share 2 cores here)
    target: float = 2.60           # validation loss, nats per byte (3.75 bits)
    steps: int = 60                # inner steps per host for the per-iteration contenders
    inner_steps: int = 10          # H of the DiLoCo contenders (their rounds: steps / H)
    eval_every: int = 5            # per-iteration contenders; DiLoCo evaluates at every sync
    wall_limit: float = 900.0      # a run still short of its steps after this is stopped (and says so)
    ddp_steps: int = 0             # steps of the DDP contenders (0: `steps`); each all-reduces the whole model
    ddp_eval_every: int = 2
    daemon_args: tuple[str, ...] = ()   # extra `peerd up` flags for the lab's daemons


# torch DDP over gloo: every step all-reduces the gradients of the whole model (the baseline users know)
DDP_CONTENDERS = ("ddp", "straggler-ddp")


def is_straggler(name: str) -> bool:
    return name.startswith("straggler")


def contenders(st: LowCommSettings) -> dict[str, list[str]]:
    """name -> `peerd train` flags. DiLoCo runs its syncs through d-psgd's policy: on `complete`
    that is the all-hosts average (DiLoCo as published), on `ring` gossip with the neighbours."""
    rounds = max(1, st.steps // st.inner_steps)
    plain = ["--iterations", str(st.steps), "--eval-every", str(st.eval_every)]
    diloco = ["--outer", "diloco", "--iterations", str(rounds), "--eval-every", "1"]
    fixed = [*diloco, "--inner-steps", str(st.inner_steps)]
    budget = [*diloco, "--round-seconds", f"{st.inner_steps * st.step_time:g}"]
    return {
        # today's algorithms on their best topology for two-sites (`peerd plan --profile two-sites`)
        "netmax": ["--algo", "netmax", "--topology", "ring", *plain],
        "ad-psgd": ["--algo", "ad-psgd", "--topology", "ring", *plain],
        "d-psgd": ["--algo", "d-psgd", "--topology", "aer", *plain],
        "diloco-all": ["--algo", "d-psgd", "--topology", "complete", *fixed],
        "diloco-all-int8": ["--algo", "d-psgd", "--topology", "complete", *fixed, "--compress", "int8"],
        "diloco-ring-int8": ["--algo", "d-psgd", "--topology", "ring", *fixed, "--compress", "int8"],
        # the outer step as plain averaging (outer lr 1, no momentum): local SGD every H steps
        "avg-all-int8": ["--algo", "d-psgd", "--topology", "complete", *fixed, "--compress", "int8",
                         "--outer-lr", "1.0", "--outer-momentum", "0"],
        "avg-all": ["--algo", "d-psgd", "--topology", "complete", *fixed, "--outer-lr", "1.0", "--outer-momentum", "0"],
        "avg-ring-int8": ["--algo", "d-psgd", "--topology", "ring", *fixed, "--compress", "int8",
                          "--outer-lr", "1.0", "--outer-momentum", "0"],
        "straggler-fixed-h": ["--algo", "d-psgd", "--topology", "complete", *fixed, "--compress", "int8"],
        "straggler-budget": ["--algo", "d-psgd", "--topology", "complete", *budget, "--compress", "int8"],
        # the same two with the outer step as plain averaging (the best low-communication row here)
        "straggler-avg-fixed-h": ["--algo", "d-psgd", "--topology", "complete", *fixed, "--compress", "int8",
                                  "--outer-lr", "1.0", "--outer-momentum", "0"],
        "straggler-avg-budget": ["--algo", "d-psgd", "--topology", "complete", *budget, "--compress", "int8",
                                 "--outer-lr", "1.0", "--outer-momentum", "0"],
    }


def evals(records: list[dict]) -> list[tuple[float, float]]:
    """(time, validation loss) of one host's evaluations, in order."""
    return [(r["t"], r["metric"]) for r in records
            if r.get("metric_name") == "loss" and r.get("metric", 0) > 0 and r.get("state") in ("training", "done")]


# evaluations averaged per host before comparing with the target: one evaluation of 2048 bytes
# moves by about +-0.02 nats between neighbouring steps, as much as 20 steps of progress here
SMOOTH = 2


def distinct(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each evaluation once: progress lines repeat the latest one until the next."""
    out: list[tuple[float, float]] = []
    for t, v in points:
        if not out or v != out[-1][1]:
            out.append((t, v))
    return out


def time_to_target(per_host: dict[str, list[tuple[float, float]]], target: float, t0: float,
                   smooth: int = SMOOTH) -> float | None:
    """Seconds from t0 until the mean over hosts of each host's last `smooth` validation losses is
    at most `target` (every host with `smooth` evaluations by then)."""
    events = sorted((t, h, v) for h, pts in per_host.items() for t, v in distinct(pts))
    recent: dict[str, collections.deque] = {h: collections.deque(maxlen=smooth) for h in per_host}
    for t, h, v in events:
        recent[h].append(v)
        if all(len(r) == smooth for r in recent.values()) and \
                statistics.fmean(statistics.fmean(r) for r in recent.values()) <= target:
            return t - t0
    return None


def idle_rates(lb: lab.Lab, cfg: Config, seconds: float = 20.0) -> dict[str, float]:
    """Bytes per second each host sends with no run (heartbeats, gossip, link probes): what a
    run's interface count holds besides the run's own traffic."""
    with TxSampler(lb, cfg.bench.tx_interval) as tx:
        t0 = time.time()
        time.sleep(seconds)
        t1 = time.time()
    return {h: tx.between(h, t0, t1) / (t1 - t0) for h in lb.hosts}


def run_one(lb: lab.Lab, name: str, flags: list[str], st: LowCommSettings, seed: int, run_dir: Path,
            straggler: str, cfg: Config, echo: Callable[[str], None]) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    idle = idle_rates(lb, cfg)
    procs, progress = [], {}
    common = ["--task", "gpt", "--model-size", st.model_size, "--context", str(st.context),
              "--batch-size", str(st.batch_size), "--eval-tokens", str(st.eval_tokens), "--init", st.init,
              "--step-time", f"{st.step_time:g}", "--world", str(len(lb.hosts)), "--seed", str(seed),
              "--json", "--trace", "--join-timeout", str(cfg.bench.swarm_timeout)]
    ddp = name in DDP_CONTENDERS
    t_start = time.time()
    with TxSampler(lb, cfg.bench.tx_interval) as tx:
        for rank, h in enumerate(lb.hosts):
            slow = "2" if is_straggler(name) and h == straggler else "1"
            progress[h] = run_dir / f"{h}.progress.jsonl"
            if ddp:
                procs.append(_start_ddp(lb, name, rank, h, st, seed, slow, run_dir, progress[h], cfg))
                continue
            with open(progress[h], "w") as fh:
                procs.append(lb.popen(h, _py("-m", "cli.main", "train", *common, *flags, "--slowdown", slow),
                                      stdout=fh, stderr=subprocess.STDOUT, text=True))

        def watch() -> str:
            parts = []
            for h in lb.hosts:
                recs = [r for r in _read_jsonl(progress[h]) if "iteration" in r]
                last = recs[-1] if recs else {}
                ev = evals(recs)
                parts.append(f"{h}:{last.get('iteration', '-')}" + (f"({ev[-1][1]:.3f})" if ev else ""))
            return " ".join(parts)
        error = None
        try:
            _wait_all(procs, st.wall_limit, f"lowcomm/{name}/seed {seed}", watch, echo, every=30.0)
        except RuntimeError as e:
            error = str(e)
        t_end = time.time()
    recs = {h: [r for r in _read_jsonl(progress[h]) if "iteration" in r] for h in lb.hosts}
    training = {h: [r for r in rs if r.get("state") == "training"] for h, rs in recs.items()}
    t0 = min((rs[0]["t"] for rs in training.values() if rs), default=t_start)
    per_host = {h: evals(rs) for h, rs in recs.items()}
    steps = {h: _trace_lines(run_dir / f"{h}.trace.jsonl") if ddp else _inner_steps(lb, h, t0) for h in lb.hosts}
    # the run's own bytes: the interface's count less what the host sends when idle
    sent = {h: max(0, round(tx.between(h, t0, t_end) - idle[h] * (t_end - t0))) for h in lb.hosts}
    finals = [pts[-1][1] for pts in per_host.values() if pts]
    ttt = time_to_target(per_host, st.target, t0)
    rec = {"contender": name, "seed": seed, "flags": flags, "settings": asdict(st), "hosts": lb.hosts,
           "straggler": straggler if is_straggler(name) else None,
           "time_to_target_s": None if ttt is None else round(ttt, 1), "target": st.target,
           "final_loss": round(statistics.fmean(finals), 4) if finals else None,
           "final_loss_per_host": {h: round(p[-1][1], 4) for h, p in per_host.items() if p},
           "evals": {h: [(round(t - t0, 1), round(v, 4)) for t, v in p] for h, p in per_host.items()},
           "wall_s": round(t_end - t0, 1), "inner_steps": steps, "bytes_sent": sent,
           "idle_bytes_per_s": {h: round(v) for h, v in idle.items()},
           "bytes_per_inner_step": {h: round(sent[h] / steps[h]) if steps[h] else None for h in lb.hosts},
           "load_avg": os.getloadavg()[0], "error": error, "code": code_version()}
    return rec


def _start_ddp(lb: lab.Lab, name: str, rank: int, host: str, st: LowCommSettings, seed: int, slowdown: str, run_dir: Path,
               progress: Path, cfg: Config) -> subprocess.Popen:
    """One rank of torch DDP over gloo in `host`'s namespace, the way torchrun users start it, on the
    same task, warm start, batch and paced step time as the peerd contenders (peerd/bench/ddp_worker.py)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    # a fresh rendezvous port per run: no TIME_WAIT clash with the last one
    port = cfg.bench.master_port + 1 + 4 * seed + DDP_CONTENDERS.index(name)
    argv = _py("-m", "torch.distributed.run", "--nnodes", str(len(lb.hosts)), "--node-rank", str(rank),
               "--master-addr", lb.ip(lb.hosts[0]), "--master-port", str(port),
               "--nproc-per-node", "1", "-m", "peerd.bench.ddp_worker", "--task", "gpt",
               "--model-size", st.model_size, "--context", str(st.context), "--eval-tokens", str(st.eval_tokens),
               "--batch-size", str(st.batch_size), "--init", st.init, "--iterations", str(st.ddp_steps or st.steps),
               "--seed", str(seed), "--eval-every", str(st.ddp_eval_every), "--step-time", f"{st.step_time:g}",
               "--slowdown", slowdown, "--timeout", str(max(cfg.bench.gloo_timeout, 300.0)),
               "--trace", str(run_dir / f"{host}.trace.jsonl"), "--progress", str(progress),
               "--model-out", str(run_dir / "ddp-model.pt"))
    with open(run_dir / f"{host}.log", "w") as fh:
        return lb.popen(host, argv, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env)


def _trace_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.startswith("{")) if path.exists() else 0


def _inner_steps(lb: lab.Lab, host: str, since: float) -> int:
    """Inner steps the host's trainer took in this run (its trace: one line per step)."""
    root = Path(lb.state["hosts"][host]["data_dir"]) / "checkpoints"
    traces = sorted(root.glob("*/trace.jsonl"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return 0
    return sum(1 for line in traces[-1].read_text().splitlines() if line.startswith("{")
               and json.loads(line).get("start", 0) >= since - 60)


def run(names: list[str], seeds: int, st: LowCommSettings, out: Path, straggler: str = "h1",
        profile_name: str = "two-sites", cfg: Config | None = None,
        echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    # the lab's settle and quiet waits shorter than the scenarios': each run's idle traffic is
    # measured and subtracted instead (idle_rates)
    cfg = cfg or Config().replace(bench_settle_timeout=150.0, bench_quiet_timeout=60.0)
    known = contenders(st)
    unknown = [n for n in names if n not in known and n not in DDP_CONTENDERS and n != "ddp-reference"]
    if unknown:
        raise ValueError(f"unknown contender(s) {unknown}; known: {', '.join(known)}")
    if not st.init or not Path(st.init).is_file():
        raise ValueError(f"--init {st.init!r}: the shared warm start file is missing (docs/real-size.md says how "
                         "to make one)")
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    earlier = _read_jsonl(results)
    other = {r.get("profile", "two-sites") for r in earlier} - {profile_name}
    if other:
        raise ValueError(f"{out} holds runs on profile {', '.join(sorted(other))}, not {profile_name}: "
                         f"use another --out")
    done = {(r["contender"], r["seed"]) for r in earlier}
    prof = profile.load(profile_name)
    records = []
    for seed in range(seeds) if "ddp-reference" in names else ():
        if ("ddp-reference", seed) in done:
            continue
        echo(f"[ddp-reference / seed {seed}] DDP's loss per step, in one process (its time: the ddp runs' s/step)")
        records.append(ddp_reference(st, len(prof.hosts), st.steps, seed=seed, echo=echo))
        records[-1]["profile"] = profile_name
        with open(results, "a") as fh:
            fh.write(json.dumps(records[-1]) + "\n")
    names = [n for n in names if n != "ddp-reference"]
    if not names:
        return records
    lab_dir = out / "lab"
    if lab_dir.exists():
        lab.down(lab_dir, cfg, purge=True)
    echo(f"== lab {profile_name} ({len(prof.hosts)} hosts): starting")
    lab.up(prof, lab_dir, cfg, daemon_args=("--heartbeat-interval", "0.5", *st.daemon_args))
    try:
        lb = lab.Lab(lab_dir)
        _prepare_lab(lb, prof, cfg, echo, out / "hosts.json")
        for seed in range(seeds):
            for name in names:
                if (name, seed) in done:
                    continue
                flags = known.get(name, ["torch DDP over gloo (peerd/bench/ddp_worker.py)"])
                echo(f"[{name} / seed {seed}] {' '.join(flags)}")
                rec = run_one(lb, name, flags, st, seed, out / name / f"seed{seed}", straggler, cfg, echo)
                rec["profile"] = profile_name
                records.append(rec)
                with open(results, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                echo(f"    target {st.target} {'after %.0fs' % rec['time_to_target_s'] if rec['time_to_target_s'] else 'not reached'}"
                     f", final loss {rec['final_loss']}, wall {rec['wall_s']}s, bytes/inner step "
                     f"{statistics.fmean(v for v in rec['bytes_per_inner_step'].values() if v) / 1e6:.2f} MB"
                     + (f"; ERROR {rec['error']}" if rec["error"] else ""))
                for h in lb.hosts:
                    shutil.rmtree(Path(lb.state["hosts"][h]["data_dir"]) / "checkpoints", ignore_errors=True)
    finally:
        lab.down(lab_dir, cfg, purge=False)
    return records


def retarget(rec: dict[str, Any], target: float) -> float | None:
    """A run's time to another target, from its recorded evaluations."""
    per_host = {h: [tuple(p) for p in pts] for h, pts in rec.get("evals", {}).items()}
    return time_to_target(per_host, target, 0.0) if per_host else None


def table(records: list[dict[str, Any]], target: float | None = None) -> str:
    """Markdown: one row per contender (median over seeds where there are several); with
    `target`, times to that validation loss instead of the one the runs were made with."""
    by: dict[str, list[dict]] = {}
    refs = {r["seed"]: r for r in records if r["contender"] == "ddp-reference"}
    for r in records:
        if r["contender"] == "ddp-reference":
            continue
        if target is not None:
            ttt = retarget(r, target)
            r = {**r, "time_to_target_s": None if ttt is None else round(ttt, 1)}
        by.setdefault(r["contender"], []).append(r)
    lines = ["| contender | seeds | time to target (s) | final val loss (nats/byte) | wall (s) | inner steps/host "
             "| MB sent/host/inner step |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rs in by.items():
        ttts = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        spread = f" ({min(ttts):.0f}-{max(ttts):.0f})" if len(ttts) > 1 else ""
        ttt = f"{statistics.median(ttts):.0f}{spread}" + ("" if len(ttts) == len(rs) else
                                                         f" ({len(ttts)}/{len(rs)} reached)") \
            if ttts else f"not within {statistics.median(r['wall_s'] for r in rs):.0f}"
        if name in DDP_CONTENDERS and len(ttts) < len(rs):
            projected = [p for r in rs if (p := projected_ddp_time(r, refs.get(r["seed"]), target)) is not None]
            if projected:
                ttt += f"; ~{statistics.median(projected):.0f} projected" + (
                    "" if len(projected) == len(rs) else f" ({len(projected)}/{len(rs)}: the others' references never reach it)")
        finals = [r["final_loss"] for r in rs if r["final_loss"] is not None]
        final = f"{statistics.median(finals):.4f}" if finals else "-"
        ref = [refs[r["seed"]] for r in rs if "final_loss" in refs.get(r["seed"], {})]
        if name in DDP_CONTENDERS and ref:   # its loss at the other contenders' step count
            final += f" ({ref[0]['steps']} steps, in-process: {statistics.median(x['final_loss'] for x in ref):.4f})"
        steps = [statistics.fmean(r["inner_steps"].values()) for r in rs]
        bps = [statistics.fmean(v for v in r["bytes_per_inner_step"].values() if v) for r in rs
               if any(r["bytes_per_inner_step"].values())]
        lines.append(f"| {name} | {len(rs)} | {ttt} | {final} | "
                     f"{statistics.median(r['wall_s'] for r in rs):.0f} | {statistics.median(steps):.0f} | "
                     f"{statistics.median(bps) / 1e6:.3f} |" if finals and bps else f"| {name} | {len(rs)} | "
                     f"{ttt} | - | - | - | - |")
    return "\n".join(lines)


def projected_ddp_time(run: dict[str, Any], ref: dict[str, Any] | None, target: float | None) -> float | None:
    """A DDP run too short to reach the target: its measured seconds per step in the lab times the
    steps the in-process reference (same math, same seed) took to reach it; None without both."""
    if ref is None:
        return None
    target = run["target"] if target is None else target
    # the lab runs evaluate only after training steps: so does the reference here (not its step 0)
    step = time_to_target({"ref": [tuple(p) for p in ref["evals"] if p[0] > 0]}, target, 0.0)
    steps = statistics.fmean(run["inner_steps"].values()) if run["inner_steps"] else 0
    if step is None or not steps or step <= steps:
        return None     # within the run's own steps its own evaluations decide
    return step * run["wall_s"] / steps


def ddp_reference(st: LowCommSettings, world: int, steps: int, seed: int = 0,
                  echo: Callable[[str], None] = print) -> dict[str, Any]:
    """DDP's loss at the same gradient steps per host, computed in one process: DDP over `world`
    hosts with batch b each is, step for step, one model trained with batch world x b on the
    average of their gradients (here: on world x b windows of the whole corpus, which DDP's
    shards together cover). Its time: the lab ddp runs' seconds per step (`projected_ddp_time`)."""
    import torch

    from peerd.train import warmstart
    from peerd.train.tasks import get_task

    torch.set_num_threads(1)      # it may run beside a lab run: one core, as one host's trainer
    torch.manual_seed(seed)
    task = get_task("gpt", model_size=st.model_size, context=st.context, eval_tokens=st.eval_tokens)
    model = task.build(seed)
    warm = warmstart.load_init(model, st.init)
    d = task.defaults
    opt = torch.optim.AdamW(model.parameters(), lr=d["lr"], betas=d.get("betas", (0.9, 0.999)),
                            weight_decay=d.get("weight_decay", 0.0))
    if warm is not None:
        warmstart.seed_torch_adam(opt, warm)
    batches = task.batches(task.shard(0, 1, False, seed), world * st.batch_size, seed)
    evals_ = [(0, task.evaluate(model)["loss"])]
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        opt.zero_grad()
        task.loss(model, next(batches)).backward()
        opt.step()
        if step % st.ddp_eval_every == 0 or step == steps:
            evals_.append((step, task.evaluate(model)["loss"]))
            echo(f"    ddp reference: step {step}, validation loss {evals_[-1][1]:.4f} "
                 f"({time.monotonic() - t0:.0f}s)")
    return {"contender": "ddp-reference", "seed": seed, "world": world, "batch_per_host": st.batch_size,
            "steps": steps, "evals": evals_, "final_loss": round(evals_[-1][1], 4),
            "first_step_at_target": next((s for s, v in evals_ if v <= st.target), None)}
