"""D-PSGD's exchange on star-6 in raw TCP, no peerd: every round each host sends SIZE bytes to both
ring neighbours and receives SIZE from both, all at once, and starts the next round when all four
are done. Run for two ring orders: the two 10 Mbit hosts (h1, h4) next to each other, and apart.
The runtime model predicts both at 2 x SIZE over 10 Mbit (1.84 s for 1.1 MB); it sees no
difference between the orders.
Run as root from the repository root (cubic must be allowed:
sysctl -w net.ipv4.tcp_allowed_congestion_control="reno bbr cubic"):
    .venv/bin/python docs/bench/experiments/ring_order_tcp.py [SIZE] [ROUNDS]"""
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ORDERS = {"10 Mbit hosts adjacent": ["h3", "h4", "h1", "h5", "h2", "h6"],
          "10 Mbit hosts apart": ["h3", "h1", "h2", "h4", "h6", "h5"]}
PORT = 7811


def worker(me: str, left: str, right: str, size: int, rounds: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((me, PORT))
    srv.listen(4)
    ins: list[socket.socket] = []
    acc = threading.Thread(target=lambda: ins.extend(srv.accept()[0] for _ in range(2)))
    acc.start()
    outs = []
    for peer in (left, right):
        for _ in range(300):
            try:
                outs.append(socket.create_connection((peer, PORT), timeout=30))
                break
            except OSError:
                time.sleep(0.1)
    acc.join()
    buf = b"x" * size

    def recv(c: socket.socket) -> None:
        n = 0
        while n < size:
            d = c.recv(min(1 << 20, size - n))   # never into the next round's bytes
            if not d:
                raise EOFError(me)
            n += len(d)
    times = []
    for _ in range(rounds):
        t0 = time.monotonic()
        th = [threading.Thread(target=s.sendall, args=(buf,)) for s in outs] + \
             [threading.Thread(target=recv, args=(c,)) for c in ins]
        for t in th:
            t.start()
        for t in th:
            t.join()
        times.append(time.monotonic() - t0)
    print(json.dumps(times), flush=True)


def main() -> None:
    from peerd.config import Config
    from peerd.lab import lab, profile
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1_100_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    d = tempfile.mkdtemp(prefix="ringtcp-")
    lab.up(profile.load("star-6", 6), d, Config(), daemons=False)
    try:
        lb = lab.Lab(d)
        for name, order in ORDERS.items():
            n, procs = len(order), {}
            for i, h in enumerate(order):
                args = [lb.ip(h), lb.ip(order[i - 1]), lb.ip(order[(i + 1) % n]), str(size), str(rounds)]
                procs[h] = lb.popen(h, [sys.executable, __file__, "--worker", *args], stdout=subprocess.PIPE, text=True)
            per = {h: statistics.median(json.loads(p.communicate(timeout=900)[0])[2:]) for h, p in procs.items()}
            print(f"{name} ({','.join(order)}): median round {statistics.median(per.values()):.3f} s; "
                  f"per host {json.dumps({h: round(t, 3) for h, t in per.items()})}", flush=True)
    finally:
        lab.down(d)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
