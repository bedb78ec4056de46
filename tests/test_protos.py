"""The checked-in stubs in epd/v1/ are exactly what protos/epd/v1/epd.proto generates."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "protos/epd/v1/epd.proto")],
        check=True,
    )
    for name in ("epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py"):
        fresh = (tmp_path / "epd/v1" / name).read_text()
        assert (ROOT / "epd/v1" / name).read_text() == fresh, f"epd/v1/{name} is stale: run `make protos`"
