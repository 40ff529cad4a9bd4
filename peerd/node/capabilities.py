"""What this host can do, found cheaply (no torch import in the daemon's start path)."""
from __future__ import annotations

import os
import shutil
import subprocess

from peerd import __version__


def detect(step_time_s: float = 0.0, site: str = "", relay: bool = False) -> dict:
    caps = {"device_kind": "cpu", "gpu_name": "", "gpu_memory_bytes": 0,
            "step_time_s": step_time_s, "cpu_count": os.cpu_count() or 1, "peerd_version": __version__,
            "site": site, "relay": relay}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=3, check=True).stdout
            first = out.strip().splitlines()[0]
            name, mem_mib = (s.strip() for s in first.rsplit(",", 1))
            caps.update(device_kind="cuda", gpu_name=name, gpu_memory_bytes=int(float(mem_mib)) * 2**20)
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            pass  # no usable GPU: stay "cpu"
    return caps
