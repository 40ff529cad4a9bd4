"""Regenerate the committed protobuf/gRPC code under peerd/v1 from protos/ (`make proto`).

`check()` renders into a temporary directory and compares, so a test can fail on stale code.
"""
from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTOS = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "peerd" / "v1").glob("*.proto"))
GENERATED_DIR = ROOT / "peerd" / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency only

    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    out = out_root / "peerd" / "v1"
    (out / "__init__.py").write_text('"""Generated from protos/peerd/v1 by `make proto`; do not edit."""\n')
    return sorted(out.iterdir())


def check() -> list[str]:
    """Names of generated files that differ from the committed ones (empty when up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in generate(Path(tmp)):
            committed = GENERATED_DIR / fresh.name
            if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                stale.append(fresh.name)
        return stale


def main() -> int:
    GENERATED_DIR.mkdir(exist_ok=True)
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
