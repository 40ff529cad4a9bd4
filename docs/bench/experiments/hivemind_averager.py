"""hivemind's DecentralizedAverager on the job `peerd bench size` gives peerd: N peers on this
machine, a flat float32 tensor of NBYTES each, averaged in one group per round. Run it with a
Python that has `hivemind==1.1.12` (a separate venv: it is no dependency of peerd):

    python docs/bench/experiments/hivemind_averager.py PEERS NBYTES ROUNDS

Prints one JSON line: seconds per round (median of the rounds after the first two, the slowest
peer) and each peer's peak resident memory.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time


def peer(rank: int, n: int, nbytes: int, rounds: int, maddrs, out) -> None:
    mp.set_start_method("fork", force=True)   # hivemind starts its own processes (a spawned child defaults to spawn)
    import hivemind
    import torch

    torch.set_num_threads(1)
    initial = list(maddrs) if rank else []
    # loopback only: nothing of this benchmark may leave the machine
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    if rank == 0:
        for a in dht.get_visible_maddrs():
            if "/ip4/127.0.0.1/" in str(a):
                maddrs.append(str(a))
    tensor = torch.randn(nbytes // 4)
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[tensor], dht=dht, prefix="peerd_bench", target_group_size=n, min_group_size=n,
        start=True)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = averager.step(timeout=600)
        times.append(time.perf_counter() - t0)
        if got is None or len(got) < n:
            times[-1] = float("nan")
    rss = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            rss = int(line.split()[1]) * 1024
    out.put((rank, times, rss))
    averager.shutdown()
    dht.shutdown()


def main() -> None:
    n, nbytes, rounds = (int(x) for x in sys.argv[1:4])
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    maddrs = manager.list()
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(0, n, nbytes, rounds, maddrs, out))]
    procs[0].start()
    while not maddrs:
        time.sleep(0.2)
    for r in range(1, n):
        procs.append(ctx.Process(target=peer, args=(r, n, nbytes, rounds, maddrs, out)))
        procs[-1].start()
    results = [out.get(timeout=3600) for _ in range(n)]
    for p in procs:
        p.join(60)
    per_peer = {r: times for r, times, _ in results}
    median = max(statistics.median(t[2:] or t) for t in per_peer.values())
    print(json.dumps({"peers": n, "nbytes": nbytes, "rounds": rounds, "s_per_round": median,
                      "rounds_s": per_peer, "peak_rss_bytes": [rss for _, _, rss in results]}))


if __name__ == "__main__":
    main()
