"""Chunk echo for chunks_run.py: server receives N-byte chunks and acks each with 1 byte; client times each chunk."""
import socket, sys, time, json
mode = sys.argv[1]
if mode == "server":
    port, n = int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(1); print("listening", flush=True)
    s.settimeout(60); c, _ = s.accept(); c.settimeout(60)
    while True:
        got = 0
        while got < n:
            b = c.recv(min(1 << 20, n - got))
            if not b: sys.exit(0)
            got += len(b)
        c.sendall(b"k")
else:
    dst, port, n, reps, gap = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    c = socket.create_connection((dst, port), timeout=60)
    buf = b"x" * n; ts = []
    for i in range(reps):
        t0 = time.monotonic(); c.sendall(buf); c.recv(1); ts.append(time.monotonic() - t0)
        time.sleep(gap)
    print(json.dumps(ts))
