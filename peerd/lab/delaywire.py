"""TAP delay wire: a userspace cable that delays (and optionally drops) Ethernet frames.

The kernel here has no netem, so one-way latency between lab sites comes from this small process.
It runs inside the lab's switch namespace and opens two non-persistent TAP devices, A and B; the
lab enslaves A to a site bridge and B to the core bridge. Frames read from A (the site sending
out) are written to B after the delay configured for their destination IPv4 address; frames from
B are written to A at once (the far side's own wire delays its outgoing traffic). Non-IPv4 frames
(ARP, IPv6) and unlisted destinations pass without delay.

Frames to one destination share one FIFO, so they are never reordered; one timer per FIFO fires
at its head's due time (and re-arms if it fired early). The TAPs vanish when the process exits, so killing it undoes it.

Spec (JSON, argv[1]): {"a": TAPNAME, "b": TAPNAME, "out": {IPV4: [delay_s, loss], ...},
"max_bytes": N, "offload": BOOL (default true)}. Prints "ready" on stdout once both TAPs exist, then logs to stderr only.
"""
from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import os
import random
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = 10            # struct virtio_net_hdr, the default TUNSETVNETHDRSZ
# What one wire carried on the 2-core development machine (one TCP flow, 20 ms, GSO offload on):
# about 520-560 Mbit/s. A delayed site link faster than this is not honoured; `peerd lab
# calibrate` measures it on the machine at hand.
CEILING_HINT_BPS = 500 * 10**6
READ_BATCH = 64          # frames per readable callback, so one direction cannot starve the other


def open_tap(name: str, offload: bool) -> int:
    """With offload, frames carry a virtio-net header and may be GSO super-frames (up to 64 KiB):
    one read and one write move what would otherwise be ~40 frames, which lifts the wire's
    ceiling severalfold. The header is passed through untouched."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    flags = IFF_TAP | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    if offload:
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def _write(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass  # EIO while the far side is down, ENOBUFS under pressure: a lost frame, as on a wire


class Direction:
    """Frames from src_fd to dst_fd, delayed per destination IPv4 address."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src_fd: int, dst_fd: int,
                 rules: dict[bytes, tuple[float, float]], max_bytes: int, hdr: int) -> None:
        self.loop, self.src, self.dst, self.rules, self.max_bytes = loop, src_fd, dst_fd, rules, max_bytes
        self.hdr = hdr  # bytes of virtio-net header before the Ethernet frame
        self.fifos: dict[bytes, collections.deque[tuple[float, bytes]]] = {}
        self.held = 0
        self.dropped = 0

    def on_readable(self) -> None:
        for _ in range(READ_BATCH):
            try:
                frame = os.read(self.src, 65536)
            except BlockingIOError:
                return
            except OSError:
                return
            h = self.hdr
            dst_ip = frame[h + 30:h + 34] if len(frame) >= h + 34 and frame[h + 12:h + 14] == b"\x08\x00" else b""
            delay, loss = self.rules.get(dst_ip, (0.0, 0.0))
            if loss and random.random() < loss:
                self.dropped += 1
                continue
            if delay <= 0:
                _write(self.dst, frame)
                continue
            if self.held + len(frame) > self.max_bytes:
                self.dropped += 1   # bound memory: more in flight than any sane rate*delay
                continue
            fifo = self.fifos.setdefault(dst_ip, collections.deque())
            fifo.append((time.monotonic() + delay, frame))
            self.held += len(frame)
            if len(fifo) == 1:
                self.loop.call_later(delay, self.flush, fifo)

    def flush(self, fifo: collections.deque[tuple[float, bytes]]) -> None:
        # Due times use time.monotonic(), not loop.time(): uvloop's clock is cached per iteration
        # and millisecond-grained, and a timer may fire a little early; a frame never leaves early.
        now = time.monotonic()
        while fifo and fifo[0][0] <= now:
            _, frame = fifo.popleft()
            self.held -= len(frame)
            _write(self.dst, frame)
        if fifo:
            self.loop.call_later(fifo[0][0] - now, self.flush, fifo)


async def serve(spec: dict) -> None:
    loop = asyncio.get_running_loop()
    rules = {socket.inet_aton(ip): (float(d), float(l)) for ip, (d, l) in spec.get("out", {}).items()}
    # Loss must hit single frames, not 64 KiB GSO bursts: no offload on a lossy wire.
    offload = bool(spec.get("offload", True)) and not any(l for _, l in rules.values())
    fa, fb = open_tap(spec["a"], offload), open_tap(spec["b"], offload)
    max_bytes = int(spec.get("max_bytes", 64 << 20))
    hdr = VNET_HDR if offload else 0
    out = Direction(loop, fa, fb, rules, max_bytes, hdr)
    back = Direction(loop, fb, fa, {}, max_bytes, hdr)
    loop.add_reader(fa, out.on_readable)
    loop.add_reader(fb, back.on_readable)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the lab closes its end of the pipe after "ready"
    await stop
    print(f"delaywire {spec['a']}<->{spec['b']}: dropped {out.dropped}+{back.dropped} frames",
          file=sys.stderr)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        import uvloop
        uvloop.run(serve(spec))
    except ImportError:
        asyncio.run(serve(spec))


if __name__ == "__main__":
    main()
