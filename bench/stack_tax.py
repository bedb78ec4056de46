"""What an idle ``epd serve`` stack costs a forward that runs beside it on the same cores.

``python -m bench.stack_tax MODEL [--dtype bfloat16] [--rounds 3] [-- ARGS for decode_step_profile]``

On one machine the stack's own processes (Ray's daemons, the controller, registry, router, encode
server, the model roles' servers) share the cores with the forwards. This starts a real local stack
in the default one-machine shape (aggregated prefill+decode, ``--dtype`` everywhere; the launcher
that ``epd serve`` uses, ``control.local.LocalStack``), leaves it idle, and runs
``bench.decode_step_profile`` (a separate process, one batched decode step in a loop; its arguments
after ``--``, by default 16 rows of 300 tokens on 2 threads, the linear layers where a replica puts them) twice a
round: once with the stack running, once with every process of the stack stopped (SIGSTOP; SIGCONT
after). Rounds alternate the two so the machine's drift falls on both. Prints each run's median
step and how long the profile's threads waited for a core a step (ready to run while another
process held it: the most direct measure of the tax, steadier than the step time on a noisy
machine), the medians' ratio; ``--json`` writes them.

Measured with it (docs/BENCHMARKS.md, "what an idle stack costs a two-thread forward"): on the
2-core test machine a two-thread decode step was ~12% slower beside the idle stack (1.123), a
one-thread step not at all (0.976); with the registry's watches waiting for changes instead of
polling, 1.063 (its threads waited 14.7 ms a step for a core against 18.2 before).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import psutil

STEP = re.compile(r"step median ([0-9.]+) ms wall, ([0-9.]+) ms CPU, waited for a core ([0-9.]+ ms|-) a step")
DEFAULT_PROFILE = ["--batch", "16", "--context", "300", "--threads", "2", "--linears", "replica", "--steps", "60"]
SETTLE_S = 5.0  # after a stop or a resume, before the next run: the stack's timers catch up


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (children, their children, ...)."""
    return [child.pid for child in psutil.Process(root).children(recursive=True)]


@contextlib.contextmanager
def stopped(pids: list[int]):
    """``pids`` stopped (SIGSTOP) inside the block, resumed after whatever happens in it."""
    held = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                held.append(pid)
        time.sleep(SETTLE_S)
        yield
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        time.sleep(SETTLE_S)


def profile(model: str, dtype: str, args: list[str]) -> tuple[float, float, float | None]:
    """One ``bench.decode_step_profile`` run: its median step's wall and CPU milliseconds, and the
    milliseconds its threads waited for a core a step (None where the kernel does not say)."""
    command = [sys.executable, "-m", "bench.decode_step_profile", model, "--dtype", dtype, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = STEP.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    waited = match.group(3)
    return float(match.group(1)), float(match.group(2)), None if waited == "-" else float(waited.split()[0])


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory (epd model create)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, alternated (default: 3)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    profile_args = extra or DEFAULT_PROFILE

    from control import flags
    from control.local import LocalStack

    config = flags.deploy_config(argparse.Namespace(), (), None, aggregate=True, serve__model_dir=args.model,
                                 serve__encode__dtype=args.dtype, serve__prefill__dtype=args.dtype,
                                 serve__decode__dtype=args.dtype)
    stack = LocalStack(config)
    runs: dict[str, list[tuple[float, float, float | None]]] = {"beside the idle stack": [], "stack stopped": []}
    try:
        print(f"stack ready at {stack.start()}", flush=True)
        time.sleep(SETTLE_S)
        for round_ in range(1, args.rounds + 1):
            runs["beside the idle stack"].append(profile(args.model, args.dtype, profile_args))
            # the stack's processes now (Ray restarts nothing while they are stopped); this one,
            # the launcher, stays running: it is the Ray driver the stack is stopped through
            with stopped(descendants(os.getpid())):
                runs["stack stopped"].append(profile(args.model, args.dtype, profile_args))
            print(f"round {round_}: " + ", ".join(f"{name} {run[-1][0]:.1f} ms (waited {_ms(run[-1][2])})"
                                                   for name, run in runs.items()), flush=True)
    finally:
        stack.stop()
    medians = {name: statistics.median(wall for wall, _, _ in values) for name, values in runs.items()}
    waits = {name: statistics.median(w for _, _, w in values) if all(w is not None for _, _, w in values) else None
             for name, values in runs.items()}
    print(f"decode_step_profile {' '.join(profile_args)} ({args.dtype}), median over {args.rounds} run(s) each:")
    for name, value in medians.items():
        print(f"  {name}: step {value:.1f} ms, waited for a core {_ms(waits[name])} a step")
    ratio = medians["beside the idle stack"] / medians["stack stopped"]
    print(f"  ratio: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile_args": profile_args, "dtype": args.dtype,
                       "runs_ms": {name: [{"wall": w, "cpu": c, "waited": q} for w, c, q in values]
                                   for name, values in runs.items()},
                       "median_ms": medians, "median_waited_ms": waits, "ratio": ratio}, f, indent=1)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


if __name__ == "__main__":
    main()
