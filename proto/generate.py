"""Regenerate the gRPC ingress's Python code from the .proto files, with grpcio-tools.

    python -m proto.generate           # rewrite the *_pb2.py, *_pb2.pyi, *_pb2_grpc.py files
    python -m proto.generate --check   # exit 1, naming the files, if they are stale

Why committed, not generated at build time: a fresh clone installs with plain
`pip install -e .` (no protoc, no build hook), and grpcio-tools stays out of the runtime
dependencies; it is in the `test` extra, pinned, because protoc's output differs between
versions. `tests/proto/test_generate.py` regenerates into a temporary folder and compares
byte for byte, so a .proto edited without regenerating fails the tests.

protoc runs with `proto/` as its include root, so the file registers as
`kvroute/v1/kvroute.proto`, the name every other language (and grpcurl, through
reflection) uses. The one line it writes for that layout, `from kvroute.v1 import ...` in
the *_grpc module, is rewritten to this package's path, `from proto.kvroute.v1 import ...`:
the only change made to protoc's output.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(rb"^(from|import) kvroute\.", re.MULTILINE)


def proto_files(root: Path = ROOT) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generated_files(root: Path = ROOT) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.name.endswith(SUFFIXES))


def generate(out: Path, root: Path = ROOT) -> list[Path]:
    """Compile every .proto under `root` into `out` (same layout); return the files made."""
    from grpc_tools import protoc  # a test/dev dependency only

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, proto_files(root)),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    made = generated_files(out)
    for rel in made:
        path = out / rel
        path.write_bytes(_IMPORT.sub(rb"\1 proto.kvroute.", path.read_bytes()))
    return made


def stale(root: Path = ROOT) -> list[str]:
    """Generated files under `root` that differ from a fresh generation (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        expected = set(generate(fresh, root))
        present = set(generated_files(root))
        return sorted(
            str(rel)
            for rel in expected | present
            if rel not in expected
            or rel not in present
            or (fresh / rel).read_bytes() != (root / rel).read_bytes()
        )


def write(root: Path = ROOT) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        made = generate(fresh, root)
        for rel in made:
            shutil.copyfile(fresh / rel, root / rel)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"stale: proto/{name} (run `python -m proto.generate`)", file=sys.stderr)
        return 1 if bad else 0
    for rel in write():
        print(f"wrote proto/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
