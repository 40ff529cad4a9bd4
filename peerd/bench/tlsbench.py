"""Data-plane throughput with and without TLS, between two processes on loopback (issue 36).

`peerd bench tls` starts a receiving process serving the data plane (the daemon's own handlers and
server options) in each of the daemon's three ways, pushes buffers of each size to it `--reps`
times after a warm-up, and reports the median rate:

- `auto`: plaintext on loopback, the fixed receive window of a plaintext loopback port;
- `off`: plaintext with gRPC's BDP-grown windows (what `--tls off` serves on a LAN);
- `on`: mutual TLS with node certificates of a cluster CA, BDP-grown windows.

The receiver is a separate process so the two sides do not share a GIL, as two daemons do not.

    python -m peerd.bench.tlsbench serve --mode on    # what the bench starts: prints its port, serves
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import grpc
import torch

from peerd.config import Config
from peerd.net import pki
from peerd.net.dataplane import AUTH_KEY, SERVICE, DataPlane, Outgoing, grpc_options
from peerd.node.channels import Tls
from peerd.node.daemon import Daemon

BENCH_SECRET = b"peerd-tls-bench-secret-not-for-use"


def _tls() -> Tls:
    trust = pki.ClusterTrust.from_secrets([BENCH_SECRET])
    creds = pki.Credentials.issued(trust)
    return Tls("on", trust.pem, creds.key_pem, creds.cert_pem)


MODES = ("auto", "off", "on")


async def _serve(mode: str) -> None:
    cfg = Config()
    dp = DataPlane(cfg, "receiver", "default", on_received=lambda rec: rec.release())
    options = Daemon(cfg, BENCH_SECRET).server_options(plaintext_loopback=mode == "auto")
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, dp.method_handlers()),))
    port = server.add_secure_port("127.0.0.1:0", _tls().server_credentials()) if mode == "on" \
        else server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the bench closes stdin
    await server.stop(0.5)
    dp.close()


@dataclass
class Record:
    mode: str
    nbytes: int
    reps: int
    median_s: float
    mb_per_s: float          # 1e6 bytes per second, median


async def _push_all(port: int, mode: str, sizes: list[int], reps: int) -> list[Record]:
    use_tls = mode == "on"
    cfg = Config()
    dp = DataPlane(cfg, "sender", "default", on_received=lambda rec: rec.release())
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, _tls().channel_credentials(), options=[
        *grpc_options(cfg), ("grpc.ssl_target_name_override", pki.TLS_NAME)]) if use_tls \
        else grpc.aio.insecure_channel(target, options=grpc_options(cfg))
    out = []
    try:
        for nbytes in sizes:
            data = Outgoing.of([torch.rand(nbytes // 4)])
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                await dp.push(channel, "receiver", data, metadata=[(AUTH_KEY, "sender")], iteration=i, kind="probe")
                if i:                                   # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            out.append(Record(mode, nbytes, reps, med, nbytes / med / 1e6))
    finally:
        await channel.close()
        dp.close()
    return out


def run(sizes: list[int], reps: int, log=print) -> list[Record]:
    records = []
    for mode in MODES:
        proc = subprocess.Popen([sys.executable, "-m", "peerd.bench.tlsbench", "serve", "--mode", mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            port = json.loads(proc.stdout.readline())["port"]
            got = asyncio.run(_push_all(port, mode, sizes, reps))
            for r in got:
                log(f"{r.mode:9s} {r.nbytes / 2**20:7.0f} MiB  {r.mb_per_s:8.0f} MB/s  (median of {r.reps})")
            records += got
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    return records


def table(records: list[Record]) -> str:
    """MB/s (1e6 bytes) by size and mode, and each mode's rate over `off` (plaintext, BDP)."""
    rate = {(r.mode, r.nbytes): r.mb_per_s for r in records}
    sizes = sorted({r.nbytes for r in records})
    lines = ["| size | --tls off (plaintext, BDP) | --tls auto on loopback (plaintext, fixed window) | --tls on (mutual TLS) |",
             "|---|---|---|---|"]
    for n in sizes:
        base = rate.get(("off", n))
        cells = []
        for mode in ("off", "auto", "on"):
            v = rate.get((mode, n))
            cells.append("-" if v is None else f"{v:.0f} MB/s" + ("" if mode == "off" or not base else f" ({v / base:.2f}x)"))
        lines.append(f"| {n / 2**20:.0f} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def records_json(records: list[Record]) -> str:
    return "\n".join(json.dumps(asdict(r)) for r in records)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--mode", choices=MODES, default="off")
    args = p.parse_args()
    if args.cmd == "serve":
        asyncio.run(_serve(args.mode))


if __name__ == "__main__":
    main()
