"""`peerd bench device`: train the `gpt` task on two loopback daemons and show where a step's time goes.

    peerd bench device [--model-size tiny] [--iterations 40] [--device auto] [--staging auto|thread]

Starts two daemons on 127.0.0.1 in a temporary directory, runs `peerd train` on both (D-PSGD, a
world of 2) with the trainer's per-iteration trace on, and prints, per host, the medians over the
iterations after a warm-up: the step (wall), the gradient's compute, the wait for the mix, and on
a GPU the device-to-host copy of x_k, the host-to-device copy of the mix, and how much of those
copies overlapped compute on the device (peerd.train.device). Without CUDA it says so, trains on
the CPU (where the parameters live in the daemon's slot and nothing is copied), and prints the
same table without copies; ``--staging thread`` runs the GPU path's staged exchange on the CPU
instead (copies on a thread), which shows the orchestration and its overlap measure at work.

The trainer is started through `peerd train --script <peerd/train/worker.py> ...`, which passes
the gpt options to it whatever options the daemon forwards to built-in tasks.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from peerd.node.localswarm import control_status

WARMUP = 5          # iterations left out of the medians (allocator, caches, the peer's start)
LOOPBACK_ARGS = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0",
                 "--link-probe-max-bytes", str(1 << 20)]


def worker_script() -> str:
    import peerd.train.worker as w
    return str(Path(w.__file__).resolve())


def script_args(*worker_args: str) -> list[str]:
    """`peerd train` arguments that run the built-in worker as a script with ``worker_args``."""
    return [f"--script={worker_script()}", *(f"--script={a}" for a in worker_args)]


def cuda_note() -> str:
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return f"CUDA {torch.version.cuda}: {names}"
    if torch.version.cuda is None:
        return f"no CUDA: torch {torch.__version__} is a CPU-only build"
    return f"no CUDA: torch {torch.__version__} is built for CUDA {torch.version.cuda}, but no GPU is visible"


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def summarize(trace: list[dict], warmup: int = WARMUP) -> dict[str, float]:
    """Medians over a trainer's trace lines past the warm-up (seconds; overlap as a fraction)."""
    lines = [r for r in trace if r["it"] > warmup] or trace
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {"iterations": len(lines),
           "step_s": med([r["t"] - r["start"] for r in lines]),
           "compute_s": med([r["compute_s"] for r in lines]),
           "mix_wait_s": med([r["mix_s"] for r in lines])}
    copies = [r["copies"] for r in lines if "copies" in r]
    if copies:
        for k in ("d2h_s", "h2d_s", "copy_s", "copy_overlap_s", "device_compute_s"):
            out[k] = med([c[k] for c in copies])
        total = sum(c["copy_s"] for c in copies)
        out["overlap_fraction"] = sum(c["copy_overlap_s"] for c in copies) / total if total > 0 else float("nan")
    return out


def run(model_size: str = "tiny", iterations: int = 40, device: str = "auto", staging: str = "auto",
        batch_size: int | None = None, workdir: Path | None = None, timeout: float | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Two loopback daemons train gpt; returns {"note", "device", "hosts": [summary per host]}."""
    from peerd.config import Config
    from peerd.node.localswarm import LocalDaemon, peerd_cmd
    from peerd.train.device import resolve_device
    timeout = timeout or Config().bench.run_timeout
    note = cuda_note()
    dev = resolve_device(device)
    log(note)
    log(f"training gpt {model_size} on {dev} ({'staged copies: ' + staging if staging != 'auto' else 'default path'}), "
        f"2 loopback daemons, {iterations} iterations")
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="peerd-device-")) if own else Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    secret = root / "secret"
    secret.write_text("device-check-" + os.urandom(8).hex() + "\n")
    secret.chmod(0o600)
    ds: list[LocalDaemon] = []
    procs: list[subprocess.Popen] = []
    try:
        for i in range(2):
            d = LocalDaemon(root / f"h{i}", secret, [ds[0].address] if ds else [], LOOPBACK_ARGS).start()
            st = _wait(lambda d=d: control_status(d.data_dir), 60, f"daemon {i} to answer")
            d.address, d.node_id = st["address"], st["node_id"]
            ds.append(d)
        _wait(lambda: all(any(p.get("state") == "alive" for p in (control_status(d.data_dir) or {}).get("peers", []))
                          for d in ds), 30, "the two daemons to see each other")
        wargs = ["--task", "gpt", "--model-size", model_size, "--device", device, "--staging", staging,
                 "--iterations", str(iterations), "--eval-every", str(iterations), "--trace"]
        if batch_size:
            wargs += ["--batch-size", str(batch_size)]
        for d in ds:
            procs.append(subprocess.Popen(
                peerd_cmd("train", "--data-dir", str(d.data_dir), "--json", "--world", "2", "--algo", "d-psgd",
                          "--iterations", str(iterations), "--join-timeout", "120", *script_args(*wargs)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        results = []
        for d, p in zip(ds, procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            recs = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            if p.returncode != 0 or not recs or recs[-1]["state"] != "done":
                logs = "".join(f.read_text(errors="replace")[-3000:] for f in d.data_dir.glob("trainer-*.log"))
                raise RuntimeError(f"`peerd train` on {d.data_dir.name} exited {p.returncode}: {err[-2000:]}\n{logs}")
            traces = sorted(d.data_dir.glob("checkpoints/*/trace.jsonl"), key=lambda f: f.stat().st_mtime)
            if not traces:
                raise RuntimeError(f"no trace.jsonl under {d.data_dir / 'checkpoints'}")
            trace = [json.loads(x) for x in traces[-1].read_text().splitlines() if x.strip()]
            s = summarize(trace)
            s["host"] = d.data_dir.name
            s["final_eval_loss"] = recs[-1]["metric"] if recs[-1]["metric_name"] == "loss" else float("nan")
            results.append(s)
        return {"note": note, "device": str(dev), "staging": staging, "model_size": model_size, "hosts": results}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for d in ds:
            d.stop()
        if own:
            import shutil
            shutil.rmtree(root, ignore_errors=True)


def table(result: dict[str, Any]) -> str:
    ms = lambda x: "—" if x != x else f"{x * 1e3:.1f}"  # noqa: E731
    head = "| host | step ms | compute ms | mix wait ms | D2H ms | H2D ms | copy ms | overlapped ms | overlap | val bpb |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for h in result["hosts"]:
        if "copy_s" in h:
            copy = (f"{ms(h['d2h_s'])} | {ms(h['h2d_s'])} | {ms(h['copy_s'])} | {ms(h['copy_overlap_s'])} "
                    f"| {h['overlap_fraction']:.0%}")
        else:
            copy = "none | none | none | — | —"
        bpb = h["final_eval_loss"] / 0.6931471805599453
        lines.append(f"| {h['host']} | {ms(h['step_s'])} | {ms(h['compute_s'])} | {ms(h['mix_wait_s'])} | {copy} "
                     f"| {bpb:.3f} |")
    out = "\n".join(lines)
    if not any("copy_s" in h for h in result["hosts"]):
        out += ("\n\nno copies: the model trains on the CPU and its parameters live in the daemon's shared-memory "
                "slot (publish copies nothing). `--staging thread` runs the GPU path's staged exchange here.")
    return out
