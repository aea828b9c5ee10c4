"""The committed gRPC stubs under plexus/proto/ match what protos/ generates today."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the stubs")

import plexus.protogen as protogen  # noqa: E402

COMMITTED = protogen.ROOT / "plexus" / "proto"
FIX = "the committed stubs are stale; run `python -m plexus.protogen` and commit plexus/proto/"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("stubs")
    return out, protogen.generate(out)


def _stubs(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*_pb2*.py*") if p.suffix in (".py", ".pyi")}


def test_regenerated_stubs_are_byte_identical_to_the_committed_ones(regenerated):
    tmp_path, generated = regenerated

    assert generated, "protoc generated nothing from protos/"
    names = {p.relative_to(tmp_path).as_posix() for p in generated}
    # every .proto yields a message module, its .pyi and a grpc module
    protos = sorted(p.relative_to(protogen.PROTO_DIR).with_suffix("").as_posix()
                    for p in protogen.PROTO_DIR.rglob("*.proto"))
    assert protos
    for stem in protos:
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names
    for path in generated:
        rel = path.relative_to(tmp_path)
        committed = COMMITTED / rel
        assert committed.exists(), f"{rel} is generated but not committed; {FIX}"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} differs from protos/; {FIX}"


def test_no_committed_stub_lacks_a_proto(regenerated):
    tmp_path, _ = regenerated

    orphans = _stubs(COMMITTED) - _stubs(tmp_path)

    assert _stubs(COMMITTED), "no committed stubs found under plexus/proto/"
    assert not orphans, (f"committed stubs {sorted(orphans)} are not generated from protos/; delete them, or restore "
                         f"their .proto; {FIX}")


def test_generated_imports_point_into_the_plexus_proto_package(regenerated):
    _, generated = regenerated

    texts = [p.read_text() for p in generated]

    assert not any("from plexus.v1 import" in t for t in texts)
    assert any("from plexus.proto.plexus.v1 import" in t for t in texts)
