"""A local driver of tensor parallelism (``epd.tensor_parallel``) for tests and benchmarks:
``run_greedy`` starts N processes (``python -m bench.tp_driver``, gloo over loopback) that each
load the checkpoint, shard it, prefill one prompt and decode greedily through
``decode_svc.batch.DecodeBatch`` + ``TextModelRunner.decode_step``, as a decode role would.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from epd.lm import HybridState, TextModelRunner
from epd.tensor_parallel import gather_state, shard_runner, split_state


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@torch.inference_mode()
def prefill(runner: TextModelRunner, prompt_ids: list[int]) -> tuple[HybridState, torch.Tensor]:
    """A text prompt (its three M-RoPE positions equal) -> its state and the first token's logits."""
    length = len(prompt_ids)
    state = runner.new_state()
    embeds = runner.embed(torch.tensor(prompt_ids))
    return state, runner.logits(runner.forward(embeds, torch.arange(length).expand(3, length), state))


@torch.inference_mode()
def decode(runner: TextModelRunner, state: HybridState, first_token: int, num_tokens: int
           ) -> tuple[list[int], torch.Tensor]:
    """``num_tokens - 1`` greedy tokens after ``first_token`` on top of ``state`` through a
    ``DecodeBatch`` and ``decode_step`` (EOS taken like any token): the tokens (``first_token``
    first) and the logits of each step after it ``[num_tokens - 1, vocab]``."""
    from decode_svc.batch import DecodeBatch

    length = state.num_tokens
    batch = DecodeBatch(runner, max_slots=1, kv_tokens=length + num_tokens + 16)
    batch.add(state)
    tokens, logits = [first_token], []
    for step in range(1, num_tokens):
        row = runner.decode_step(batch, [tokens[-1]], [length + step - 1])[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(logits) if logits else torch.empty(0)


def greedy(runner: TextModelRunner, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """``prefill`` then ``decode``: ``num_tokens`` greedy tokens and the float32 logits of every
    step ``[num_tokens, vocab]``."""
    state, first = prefill(runner, prompt_ids)
    tokens, rest = decode(runner, state, int(first.argmax()), num_tokens)
    return tokens, torch.cat([first.unsqueeze(0), rest]) if len(rest) else first.unsqueeze(0)


def save_state(path: str, state: HybridState, first_token: int) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in state.named_tensors()}
    save_file(tensors, path, metadata={"num_tokens": str(state.num_tokens), "first_token": str(first_token)})


def load_state(path: str, num_layers: int) -> tuple[HybridState, int]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return HybridState.from_named_tensors(num_layers, int(meta["num_tokens"]), tensors), int(meta["first_token"])


def _worker(rank: int, world: int, port: int, model_dir: str, prompt_ids: list[int], num_tokens: int,
            dtype: str, out_path: str, state_in: str = "", state_out: str = "") -> None:
    """One rank: prefill (or take the whole state in ``state_in`` and split it), then either hand
    the gathered whole state to ``state_out`` or decode; rank 0 writes what it got."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        runner = shard_runner(TextModelRunner.load(model_dir, dtype=dtype, device="cpu", prepack=False), rank, world)
        if state_in:
            whole, first_token = load_state(state_in, runner.num_layers)
            state, first = split_state(runner, whole, rank, world), None
        else:
            state, first = prefill(runner, prompt_ids)
            first_token = int(first.argmax())
        if state_out:
            whole = gather_state(runner, state, world)
            if rank == 0:
                save_state(state_out, whole, first_token)
            return
        tokens, logits = decode(runner, state, first_token, num_tokens)
        if first is not None:
            logits = torch.cat([first.unsqueeze(0), logits]) if len(logits) else first.unsqueeze(0)
        if rank == 0:
            from safetensors.torch import save_file

            save_file({"tokens": torch.tensor(tokens), "logits": logits.contiguous()}, out_path)
    finally:
        dist.destroy_process_group()


def run_greedy(model_dir: str, prompt_ids: list[int], num_tokens: int, world: int = 2, dtype: str = "float32",
               threads: int = 1, timeout_s: float = 300, state_in: str = "", state_out: str = ""
               ) -> tuple[list[int], torch.Tensor]:
    """``greedy`` with the language model split over ``world`` local processes (gloo over
    loopback), each ``python -m bench.tp_driver`` with ``threads`` torch threads. With
    ``state_out`` the ranks only prefill and write the gathered whole state there (``load_state``;
    returns no tokens); with ``state_in`` they start from that whole state (split per rank) and
    only decode (the logits then start at the second token). Raises RuntimeError with a rank's
    stderr when one fails."""
    import json
    import subprocess
    import sys
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="epd-tp-") as tmp:
        out_path = os.path.join(tmp, "rank0.safetensors")
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        handoff = [*(["--state-in", state_in] if state_in else []), *(["--state-out", state_out] if state_out else [])]
        ranks = [subprocess.Popen(
            [sys.executable, "-m", "bench.tp_driver", "--rank", str(rank), "--world", str(world),
             "--port", str(port), "--model", model_dir, "--prompt-ids", json.dumps(list(prompt_ids)),
             "--num-tokens", str(num_tokens), "--dtype", dtype, "--out", out_path, *handoff],
            stderr=subprocess.PIPE, text=True, env=env) for rank in range(world)]
        try:
            errors = [process.communicate(timeout=timeout_s)[1] for process in ranks]
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        failed = [(rank, err) for rank, (process, err) in enumerate(zip(ranks, errors)) if process.returncode]
        if failed:
            raise RuntimeError(f"tensor-parallel rank {failed[0][0]} failed: {failed[0][1][-2000:]}")
        if state_out:
            return [], torch.empty(0)
        result = load_file(out_path)
    return result["tokens"].tolist(), result["logits"]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="one rank of a tensor-parallel greedy run (see run_greedy)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    parser.add_argument("--num-tokens", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    parser.add_argument("--state-in", default="", help="start from this whole state (safetensors): decode only")
    parser.add_argument("--state-out", default="", help="prefill only; write the gathered whole state here")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _worker(args.rank, args.world, args.port, args.model, json.loads(args.prompt_ids), args.num_tokens,
            args.dtype, args.out, args.state_in, args.state_out)


if __name__ == "__main__":
    main()
