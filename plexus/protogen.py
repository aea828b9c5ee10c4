"""Regenerate the committed gRPC stubs under plexus/proto/ from protos/ (dev only)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc over protos/ into out_dir; returns the generated files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    sources = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its output above")
    generated = sorted(p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in generated:
        _absolutise_imports(path)
    return generated


def _absolutise_imports(path: Path) -> None:
    # protoc emits `from plexus.v1 import x_pb2`; the stubs live in the plexus.proto package.
    text = path.read_text()
    path.write_text(text.replace("from plexus.v1 import", "from plexus.proto.plexus.v1 import"))


if __name__ == "__main__":
    written = generate(ROOT / "plexus" / "proto")
    print("\n".join(str(p.relative_to(ROOT)) for p in written), file=sys.stdout)
