"""Announce hostile and garbage `_peerd._tcp.local.` services with raw python-zeroconf.

Run inside a lab namespace: `python tests/mdns_rogue.py IP RUN_ID VICTIM_ID SECONDS`. Prints one JSON
line {"ready": [names...]} once every service is registered, then stays up SECONDS and withdraws.
The expected rejection reason of each name is in ROGUES (a substring of MdnsDiscovery's reason).
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys

from peerd import PROTOCOL_VERSION

V = f"v={PROTOCOL_VERSION}".encode()        # the version daemons speak: rejected for another reason


def _txt(*items: bytes) -> bytes:
    return b"".join(bytes([len(i)]) + i for i in items)


def rogues(run_id: str, victim: str) -> dict[str, tuple[bytes, int, str]]:
    """instance -> (raw TXT, port, expected reason substring)."""
    ok = lambda name, *extra: _txt(b"id=" + name.encode(), V, b"run=" + run_id.encode(), *extra)
    return {
        "rogue-badver": (_txt(b"id=rogue-badver", b"v=99", b"run=" + run_id.encode()), 7070,
                         "protocol version 99"),
        "rogue-otherrun": (_txt(b"id=rogue-otherrun", V, b"run=another-run"), 7070, "other run"),
        "rogue-huge": (ok("rogue-huge", *[b"x%d=" % i + b"a" * 200 for i in range(8)]), 7070,
                       "TXT record is"),
        "rogue-biggpu": (ok("rogue-biggpu", b"gpu=" + b"G" * 240), 7070, "TXT gpu is 240 bytes"),
        "rogue-garbage": (b"\xff\xfe\x00\x07garbage\x99", 7070, "TXT"),
        "rogue-noid": (_txt(V, b"run=" + run_id.encode()), 7070, "TXT has no id"),
        "rogue-mismatch": (ok(victim), 7070, "differs from the instance name"),
        "rogue-badmem": (ok("rogue-badmem", b"gmem=lots"), 7070, "not a non-negative integer"),
        "rogue-dupkey": (ok("rogue-dupkey", b"run=" + run_id.encode()), 7070, "repeated"),
        "rogue-utf8": (ok("rogue-utf8", b"gpu=\xc3\x28"), 7070, "not UTF-8"),
        "rogue-ctl": (ok("rogue-ctl", b"pv=1\x1b[2J"), 7070, "control characters"),
        "rogue name!": (ok("rogue name!"), 7070, "instance name is not a node id"),
    }


async def main(ip: str, run_id: str, victim: str, seconds: float) -> None:
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    azc = AsyncZeroconf(interfaces=[ip])
    infos = [AsyncServiceInfo("_peerd._tcp.local.", f"{name}._peerd._tcp.local.", port=port,
                              properties=txt, server=f"rogue{i}.local.", addresses=[socket.inet_aton(ip)])
             for i, (name, (txt, port, _)) in enumerate(rogues(run_id, victim).items())]
    tasks = await asyncio.gather(*(azc.async_register_service(i) for i in infos))
    await asyncio.gather(*tasks)
    print(json.dumps({"ready": [i.name for i in infos]}), flush=True)
    await asyncio.sleep(seconds)
    await azc.async_unregister_all_services()
    await azc.async_close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
