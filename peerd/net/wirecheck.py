"""Checks and bounds for what comes from the wire (and the local control socket): strings echoed into
logs and errors, addresses learned from peers, node ids, numbers that must be finite.

Pure: no I/O.
"""
from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

MAX_ADDRESS_LEN = 256
_HOSTNAME = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def clip(value: Any, limit: int = 120) -> str:
    """`repr(value)` (strings without quotes' surprises: control characters escaped) cut to
    `limit` characters, saying how long it was: what a log line or an error may echo of a caller's
    string."""
    text = value if isinstance(value, str) else repr(value)
    shown = repr(text[:limit])
    return shown if len(text) <= limit else f"{shown}...({len(text)} characters)"


def cut(text: str, limit: int = 120) -> str:
    """`text` itself (already safe to show, e.g. a repr) cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a peer address, "host:port" or "[v6]:port", or None when it is not one a
    daemon should dial: an IP literal or a DNS name, a port 1..65535, nothing else (no scheme such
    as unix:// or dns:///, no path, no user, no whitespace)."""
    if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS_LEN or not address.isascii():
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            return None
    try:
        return str(ipaddress.IPv4Address(host)), int(port)
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(host) and not host.replace(".", "").isdigit():
        return host.lower(), int(port)
    return None


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def finite(value: float, default: float = 0.0) -> float:
    """`value` when it is a finite number, else `default`."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else default


def strict_json_value(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None (JSON has no such numbers: json.dumps
    would write NaN, which strict parsers refuse), recursively through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(v) for v in value]
    return value
