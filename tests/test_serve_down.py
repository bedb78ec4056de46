"""One real `epd serve`, then what an operator does to it from another shell (issue 21):
`epd status` answers (its header the state now) and is quiet when its reader goes away
(`epd status | head -4`), and `epd down` ends `epd serve` itself, not only its roles."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ServeProcess, epd, ray_address


def test_status_then_down_ends_epd_serve(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    server = ServeProcess(tiny_model_dir, "--encoders", "1", log_path=str(log))
    try:
        ray = ray_address(server)
        out = epd("status", "--address", ray, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "router: 1 of 1 serving" in out.stdout.splitlines(), out.stdout

        read, write = os.pipe()
        os.close(read)  # the reader is gone before status writes a byte: `| head -0`
        closed = subprocess.run([sys.executable, "-m", "control.cli", "status", "--address", ray], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120)
        os.close(write)
        assert closed.returncode == 141, (closed.returncode, closed.stderr)
        assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr

        down = epd("down", "--address", ray, timeout=300)
        assert down.returncode == 0, down.stderr
        assert "epd deployment 'epd' stopped" in down.stdout, down.stdout
        server.proc.wait(timeout=90)  # before: `epd serve` ran on with nothing behind it
        assert server.proc.returncode == 0, log.read_text()[-3000:]
        assert "epd serve: the deployment was stopped (`epd down`)" in log.read_text(), log.read_text()[-3000:]
    finally:
        left = server.stop()
    assert left == [], f"epd serve left processes behind: {left}"
