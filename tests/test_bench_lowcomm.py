"""`peerd bench lowcomm`'s parts that need no lab: time to a target, the table (with a DDP run too
short to reach it projected from the in-process reference), and the DDP baseline's worker on the
gpt task (torch DDP over gloo on loopback, from a warm start with Adam's moments)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from peerd.bench import lowcomm


def _run(name: str, seed: int, evals: dict, steps: int, wall: float, target: float = 2.6) -> dict:
    return {"contender": name, "seed": seed, "evals": evals, "time_to_target_s": None, "target": target,
            "final_loss": min(v for pts in evals.values() for _, v in pts), "wall_s": wall,
            "inner_steps": dict.fromkeys(evals, steps), "bytes_per_inner_step": dict.fromkeys(evals, 1e6)}


def test_time_to_target_waits_for_the_mean_of_every_hosts_latest_evaluations():
    per_host = {"a": [(10.0, 2.7), (11.0, 2.7), (20.0, 2.5)], "b": [(12.0, 2.8), (25.0, 2.6), (30.0, 2.4)]}
    # one evaluation per host: the first time the mean of the latest ones is low enough
    assert lowcomm.time_to_target(per_host, 2.55, 0.0, smooth=1) == 25.0     # (2.5 + 2.6) / 2
    assert lowcomm.time_to_target(per_host, 2.45, 5.0, smooth=1) == 25.0     # (2.5 + 2.4) / 2 at t=30, from t0=5
    # two (the default): a's repeated progress line counts once; b's first pair is (2.8, 2.6)
    assert lowcomm.time_to_target(per_host, 2.66, 0.0) == 25.0               # (2.6 + 2.7) / 2
    assert lowcomm.time_to_target(per_host, 2.55, 0.0) == 30.0               # (2.6 + 2.5) / 2
    assert lowcomm.time_to_target(per_host, 2.3, 0.0) is None


def test_table_gives_medians_and_ranges_over_seeds_and_projects_a_short_ddp_run():
    recs = [_run("avg", s, {"a": [(0, 2.7), (t, 2.5)], "b": [(0, 2.7), (t, 2.5)]}, 60, 300.0)  # 2.6 at t
            for s, t in enumerate((100.0, 120.0, 140.0))]
    for s in range(3):   # DDP: 10 steps in 300 s (30 s/step), never at 2.6; its reference (smoothed) reaches it at step 30
        recs.append(_run("ddp", s, {"a": [(0, 2.7), (300, 2.65)], "b": [(0, 2.7), (300, 2.65)]}, 10, 300.0))
        recs.append({"contender": "ddp-reference", "seed": s,
                     "evals": [(0, 2.7), (10, 2.65), (20, 2.6), (30, 2.55)], "final_loss": 2.55, "steps": 30})
    table = lowcomm.table(recs, target=2.6).splitlines()
    avg = next(line for line in table if line.startswith("| avg "))
    ddp = next(line for line in table if line.startswith("| ddp "))
    assert "| 3 | 120 (100-140) |" in avg
    assert "not within 300; ~900 projected" in ddp
    assert "| 2.6500 (30 steps, in-process: 2.5500) |" in ddp     # its loss at the others' step count
    assert not any("ddp-reference" in line for line in table)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_ddp_baseline_trains_the_gpt_from_a_warm_start_with_adams_moments(tmp_path):
    """Two DDP ranks over gloo on loopback, started the way torchrun users start them, train the
    tiny gpt from a warm start: validation losses are recorded as peerd train's are, and rank 0's
    final model is where the reference (one process, batch 2 x 2, the same warm Adam) lands."""
    from peerd.train import warmstart
    from peerd.train.tasks import get_task

    task = get_task("gpt", model_size="tiny", eval_tokens=512)
    warm = tmp_path / "warm.pt"
    warmstart.make(task, 3, 4, warm, eval_every=3, echo=lambda s: None)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = []
    for rank in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1",
                "-m", "peerd.bench.ddp_worker", "--task", "gpt", "--model-size", "tiny", "--eval-tokens", "512",
                "--batch-size", "2", "--init", str(warm), "--iterations", "4", "--eval-every", "2",
                "--trace", str(tmp_path / f"trace{rank}.jsonl"), "--progress", str(tmp_path / f"p{rank}.jsonl"),
                "--model-out", str(tmp_path / "model.pt")]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "p0.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r["metric_name"] == "loss"]
    assert [r["iteration"] for r in evals] == [2, 4] and all(2.0 < r["metric"] < 6.0 for r in evals)
    assert len((tmp_path / "trace1.jsonl").read_text().splitlines()) == 4
    # rank 0's model: DDP averages the two ranks' gradients, each on its own shard's batches
    model = task.build(0)
    state = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    ref = task.build(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=task.defaults["lr"], betas=task.defaults["betas"], weight_decay=0.0)
    warmstart.seed_torch_adam(opt, warmstart.load_init(ref, warm))
    shards = [task.batches(task.shard(r, 2, False, 0), 2, 0) for r in range(2)]
    for _ in range(4):
        opt.zero_grad()
        grads = []
        for it in shards:
            ref.zero_grad()
            task.loss(ref, next(it)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    model.load_state_dict(state)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert diff < 1e-4, diff
