"""The committed generated code matches the .proto files (regenerated into a tmp dir)."""

from __future__ import annotations

from pathlib import Path

from proto import generate


def test_generated_code_is_fresh() -> None:
    stale = generate.stale()
    assert not stale, f"stale generated code {stale}: run `python -m proto.generate`"


def test_stale_check_sees_an_edited_proto(tmp_path: Path) -> None:
    """The check itself works: a copy whose .proto gained a field is reported stale."""
    for rel in [*generate.proto_files(), *generate.generated_files()]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((generate.ROOT / rel).read_bytes())
    proto = tmp_path / "kvroute/v1/kvroute.proto"
    proto.write_text(
        proto.read_text().replace("message TokenIds {", "message TokenIds {\n  string x = 9;")
    )
    assert generate.stale(tmp_path) == [
        "kvroute/v1/kvroute_pb2.py",
        "kvroute/v1/kvroute_pb2.pyi",
    ]


def test_generated_imports_point_into_this_package() -> None:
    grpc_module = (generate.ROOT / "kvroute/v1/kvroute_pb2_grpc.py").read_text()
    assert "from proto.kvroute.v1 import kvroute_pb2" in grpc_module
