"""Measuring tools run inside lab hosts (`peerd lab exec H -- python -m peerd.lab.probe ...`).

    ping DST... [--count N] [--interval S] [--timeout S]   ICMP echo RTTs (raw socket; root)
    sink --port P --bytes N [--timeout S]                 receive N bytes on one TCP connection
    send DST:P --bytes N [--timeout S]                    send N bytes

Each prints one JSON line (ping: one per destination). `sink` first prints "listening" so a
caller knows when to start the sender; its goodput is receiver-side, from the first byte to the
last, and "steady" skips the first 20 % of the bytes (slow start and the shaper's initial burst).
Every wait is bounded by --timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def ping(dst: str, count: int, interval: float, timeout: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    rtts: list[float | None] = []
    for seq in range(count):
        payload = struct.pack("!d", time.monotonic()) + b"peerd-lab"
        hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        sock.sendto(struct.pack("!BBHHH", 8, 0, _checksum(hdr + payload), ident, seq) + payload, (dst, 0))
        t0, got = time.monotonic(), None
        deadline = t0 + timeout
        while got is None and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                pkt, addr = sock.recvfrom(2048)
            except TimeoutError:
                break
            ihl = (pkt[0] & 0x0F) * 4
            typ, _, _, rid, rseq = struct.unpack("!BBHHH", pkt[ihl:ihl + 8])
            if typ == 0 and rid == ident and rseq == seq and addr[0] == dst:
                got = (time.monotonic() - t0) * 1000
        rtts.append(got)
        if seq + 1 < count:
            time.sleep(interval)
    ok = [r for r in rtts if r is not None]
    return {"dst": dst, "rtts_ms": rtts, "received": len(ok), "sent": count,
            "min_ms": min(ok) if ok else None, "median_ms": sorted(ok)[len(ok) // 2] if ok else None}


def sink(port: int, nbytes: int, timeout: float) -> dict:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(timeout)
    print("listening", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    buf = bytearray(1 << 20)
    got, first, mark = 0, None, None
    while got < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            break
        now = time.monotonic()
        if first is None:
            first = now
        got += n
        if mark is None and got >= nbytes // 5:
            mark = (now, got)
    end = time.monotonic()
    span = max(end - (first or end), 1e-9)
    steady = (got - mark[1]) * 8 / max(end - mark[0], 1e-9) if mark and got > mark[1] else None
    return {"bytes": got, "seconds": span, "goodput_bps": got * 8 / span, "steady_bps": steady}


def send(dst: str, nbytes: int, timeout: float) -> dict:
    host, _, port = dst.rpartition(":")
    t0 = time.monotonic()
    s = socket.create_connection((host, int(port)), timeout=timeout)
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        s.sendall(chunk[:min(left, len(chunk))])
        left -= min(left, len(chunk))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # wait for the receiver to close: every byte arrived
    return {"bytes": nbytes, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m peerd.lab.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ping")
    p.add_argument("dst", nargs="+")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=2.0)
    k = sub.add_parser("sink")
    k.add_argument("--port", type=int, required=True)
    k.add_argument("--bytes", type=int, required=True)
    k.add_argument("--timeout", type=float, default=30.0)
    s = sub.add_parser("send")
    s.add_argument("dst")
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args(argv)
    if a.cmd == "ping":
        for dst in a.dst:
            print(json.dumps(ping(dst, a.count, a.interval, a.timeout)), flush=True)
        return
    elif a.cmd == "sink":
        out = sink(a.port, a.bytes, a.timeout)
    else:
        out = send(a.dst, a.bytes, a.timeout)
    print(json.dumps(out), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
