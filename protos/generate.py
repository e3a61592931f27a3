"""Generate the Python modules for protos/specsplit/v1/*.proto (run from anywhere).

    python protos/generate.py          # or: make protos

protoc runs from protos/ with `-I .`, so a file's proto path is `specsplit/v1/X.proto` and the
generated modules import each other as `specsplit.v1.X_pb2`: the import name equals the proto
package. The installed package reaches them as specsplit.v1 (specsplit/v1 is a link to
protos/specsplit/v1). The outputs are never edited by hand.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # protos/: the include root
PROTO_DIR = ROOT / "specsplit" / "v1"


def main() -> int:
    from grpc_tools import protoc

    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    if not protos:
        print(f"no .proto files in {PROTO_DIR}", file=sys.stderr)
        return 1
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(["grpc_tools.protoc", "-I.", f"-I{well_known}", "--python_out=.", "--pyi_out=.",
                          "--grpc_python_out=.", *protos])
    finally:
        os.chdir(cwd)
    if rc != 0:
        print("protoc failed", file=sys.stderr)
        return rc
    for p in protos:
        print(f"generated {p[:-len('.proto')]}_pb2.py, _pb2.pyi, _pb2_grpc.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
