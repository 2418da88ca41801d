"""Regenerate barrel_pb2*.py from proto/barrel.proto.

Run from the repository root: `python -m barreld.rpc.generate` (needs the `test` extra for grpcio-tools).
The extra pins grpcio-tools to one release: its version is written into the generated code, so a looser pin
lets a new release make the committed files stale on a fresh install.
`--out DIR` writes elsewhere; the staleness test uses it to compare against the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED = ("barrel_pb2.py", "barrel_pb2.pyi", "barrel_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc into out_dir and make the grpc module import its sibling as part of this package."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main([
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "barrel.proto"),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "barrel_pb2_grpc.py"
    text = re.sub(r"^import barrel_pb2 as", "from barreld.rpc import barrel_pb2 as",
                  grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR)
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
