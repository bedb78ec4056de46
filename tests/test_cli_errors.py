"""Every user error of the `epd` command ends in one line and a non-zero exit, never a traceback:
`epd <command>: error: ...` for what the command itself refuses (after argparse's usage), or the
service's `STATUS_NAME: message`. Each case is the real command run as a subprocess, including the
cases issue 11 lists (out-of-range numbers, an existing --out, a busy --port, Ctrl-C, --addr
without a port, --max-model-len past the model)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.conftest import epd

NO_SERVER = "127.0.0.1:9"  # the discard port: nothing answers gRPC there


def assert_one_line_error(out: subprocess.CompletedProcess, prefix: str, *fragments: str, code: int = 2) -> str:
    """The command failed with ``code``, printed no traceback, and its error is one line starting
    with ``prefix`` (argparse's usage may come before it); returns that line."""
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    error = [line for line in lines if line.startswith(prefix)]
    assert len(error) == 1 and error[0] == lines[-1], out.stderr
    for fragment in fragments:
        assert fragment in error[0], error[0]
    return error[0]


@pytest.mark.parametrize("flag,value,message", [
    ("--seed", "-1", "argument --seed: must be in [0, 18446744073709551615], got -1"),
    ("--max-tokens", "99999999999", "argument --max-tokens: must be in [1, 2147483647], got 99999999999"),
    ("--top-k", "99999999999", "argument --top-k: must be in [0, 2147483647], got 99999999999"),
    ("--max-pixels", "-5", "argument --max-pixels: must be in [0,"),  # 0: the model's, as the server says
    ("--temperature", "nan", "argument --temperature: must be in [0, 1e+06], got nan"),
    ("--top-p", "2", "argument --top-p: must be in [0, 1], got 2"),
    ("--max-tokens", "ten", "argument --max-tokens: expected an integer, got 'ten'"),
])
def test_generate_refuses_out_of_range_numbers_in_one_line(flag, value, message):
    out = epd("generate", "--addr", NO_SERVER, "--prompt", "hi", flag, value, timeout=60)
    assert_one_line_error(out, "epd generate: error:", message)


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", ":50051"])
def test_an_address_needs_a_port(addr):
    out = epd("generate", "--addr", addr, "--prompt", "hi", timeout=60)
    assert_one_line_error(out, "epd generate: error:", "argument --addr: expected HOST:PORT")


def test_status_watch_needs_a_sensible_interval():
    out = epd("status", "--address", "127.0.0.1:6379", "--watch", "0", timeout=60)
    assert_one_line_error(out, "epd status: error:", "argument --watch: must be in [0.1, 3600], got 0")


def test_generate_files_that_cannot_be_read_are_one_line(tmp_path):
    out = epd("generate", "--addr", NO_SERVER, "--prompt", "hi", "--image", str(tmp_path / "missing.png"), timeout=60)
    assert_one_line_error(out, "epd generate: error:", "cannot read image")
    bad = tmp_path / "chat.json"
    bad.write_text("[{not json")
    out = epd("generate", "--addr", NO_SERVER, "--messages", str(bad), timeout=60)
    assert_one_line_error(out, "epd generate: error:", "is not valid JSON")


def test_a_failed_call_prints_the_status_name_and_message():
    out = epd("generate", "--addr", NO_SERVER, "--prompt", "hi", "--timeout", "20", timeout=60)
    line = assert_one_line_error(out, "UNAVAILABLE: ", code=1)
    assert len(line) > len("UNAVAILABLE: ")


def test_ctrl_c_on_generate_exits_quietly_with_130():
    """A router that takes the call and holds it: SIGINT is sent once the call is known to be in
    flight at the server (a real gRPC server speaking HTTP/2, so the client never gives up on
    its own first, as it did against a bare TCP listener under load: "ping timeout")."""
    from concurrent import futures

    import grpc

    in_flight, release = threading.Event(), threading.Event()

    def generate(request, context):
        in_flight.set()
        while context.is_active() and not release.wait(0.05):
            pass
        return iter(())

    # the client's keepalive pings accepted as every epd server accepts them (a default server
    # answers the third, ~15 s in, with GOAWAY "too_many_pings")
    from epd.rpc import KEEPALIVE_OPTIONS

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=KEEPALIVE_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "epd.v1.Router", {"Generate": grpc.unary_stream_rpc_method_handler(generate)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # SIGINT at its default in the child, as in a terminal: a test run started in the background
    # by a shell without job control ignores SIGINT, the child inherits that, and Python then
    # installs no handler for it (the call would only end by its own failure)
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", "generate", "--addr", f"127.0.0.1:{port}",
                             "--prompt", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert in_flight.wait(120), "epd generate's call never reached the server"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        release.set()
        server.stop(0).wait(10)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip() == "", stderr


def test_model_create_refuses_a_non_empty_out_and_overwrite_replaces_it(tmp_path):
    out_dir = tmp_path / "model"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    out = epd("model", "create", "--preset", "tiny", "--out", str(out_dir), timeout=120)
    assert_one_line_error(out, "epd model create: error:", "exists and is not empty; pass --overwrite")
    assert (out_dir / "notes.txt").exists() and not (out_dir / "config.json").exists()
    out = epd("model", "create", "--preset", "tiny", "--out", str(out_dir), "--overwrite", timeout=300)
    assert out.returncode == 0, out.stderr
    assert (out_dir / "config.json").is_file()


def test_model_create_refuses_an_existing_out_before_importing_torch(tmp_path):
    """The refusal takes a fraction of a second: it comes before torch and transformers are imported."""
    (tmp_path / "notes.txt").write_text("mine")
    check = ("import sys\nfrom control import cli\ntry:\n    cli.main(['model', 'create', '--preset', 'tiny', "
             f"'--out', {str(tmp_path)!r}])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules, code)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False", "2"], (out.stdout, out.stderr)
    assert "exists and is not empty; pass --overwrite" in out.stderr


@pytest.mark.parametrize("command", ["scale", "status", "down"])
def test_every_argument_of_the_deployment_commands_has_help(command):
    out = epd(command, "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--namespace NAMESPACE Ray namespace of the deployment" in text, text
    assert "--connect-timeout S seconds to reach the deployment before giving up (default: 10.0)" in text, text
    if command == "scale":
        assert "count replicas the role should have, in [1, 256]" in text, text
        assert "the role to scale" in text, text


def test_serve_refuses_a_busy_port_before_starting_ray(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = epd("serve", "--model", tiny_model_dir, "--port", str(port), timeout=120)
    assert_one_line_error(out, "epd serve: error:", f"--port {port}: cannot listen on 127.0.0.1:{port}")
    assert "ray at" not in out.stdout  # refused before Ray was started


@pytest.mark.parametrize("args,message", [
    (["--max-model-len", "20000"], "router.max_model_len: 20000 is more than the model's max_position_embeddings (8192)"),
    (["--max-images-per-request", "-1"], "router.max_images_per_request: must be in [0, 4096], got -1"),
    (["--max-request-mb", "0"], "router.max_request_mb: must be in [1, 2047], got 0"),
    (["--max-batch-size", "0"], "decode.max_batch_size: must be in [1, 1024], got 0"),
    (["--redis", "http://example:6379"], "store.redis_url: must start with redis://"),
    (["--config", "/nonexistent/roles.toml"], "deploy file /nonexistent/roles.toml"),
    (["--encoders", "many"], "argument --encoders: invalid int value"),
    (["--decode-cpus", "0-"], "decode.cpus: not a CPU list: '0-' (write it as 0-3 or 0,2)"),
])
def test_serve_config_errors_are_one_line(tiny_model_dir, args, message):
    out = epd("serve", "--model", tiny_model_dir, *args, timeout=120)
    assert_one_line_error(out, "epd serve: error:", message)
    assert "ray at" not in out.stdout


def test_serve_without_a_checkpoint_is_one_line(tmp_path):
    out = epd("serve", "--model", str(tmp_path / "nothing"), timeout=120)
    assert_one_line_error(out, "epd serve: error:", "is not a checkpoint directory")


def test_no_command_prints_help_and_fails():
    out = epd(timeout=60)
    assert out.returncode == 2 and "usage: epd" in out.stdout and "Traceback" not in out.stderr


def test_serve_with_an_unreachable_redis_stops_in_one_line(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = epd("serve", "--model", tiny_model_dir, "--redis", f"redis://127.0.0.1:{closed}/0", timeout=180)
    assert_one_line_error(out, "epd serve: stopped: ", f"cannot reach Redis at redis://127.0.0.1:{closed}/0",
                          code=1)


def test_a_wrong_control_plane_policy_is_one_line_from_serve_and_bench(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("EPD_CONTROL_POLICY", "lowest")
    message = "EPD_CONTROL_POLICY='lowest': expected idle, batch or default"
    assert_one_line_error(epd("serve", "--model", tiny_model_dir, timeout=180), "epd serve: stopped: ", message, code=1)
    out = epd("bench", "--model", tiny_model_dir, "--num-requests", "1", "--concurrency", "1", "--output-tokens", "2",
              "--images-per-request", "0", "--prompt-tokens", "8", timeout=180)
    assert_one_line_error(out, "epd bench: error: ", message, code=1)


def test_deploy_without_internal_tls_refuses_to_send_the_token_in_clear(tiny_model_dir):
    """Across nodes the internal token would travel in clear: one line naming the flag and the TLS
    options, before Ray is reached (nothing listens at the address: the refusal comes first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = epd("deploy", "--address", f"127.0.0.1:{closed}", "--model", tiny_model_dir,
              "--redis", "redis://10.0.0.1:6379/0", timeout=120)
    assert_one_line_error(out, "epd deploy: error:", "internal token in clear", "--allow-plaintext-internal",
                          "--internal-tls-ca", "--internal-tls-cert", "--internal-tls-key")
    # With the flag the check passes and the command goes on (here: to the address nobody answers).
    out = epd("deploy", "--address", f"127.0.0.1:{closed}", "--model", tiny_model_dir,
              "--redis", "redis://10.0.0.1:6379/0", "--allow-plaintext-internal", timeout=120)
    assert_one_line_error(out, "epd deploy: no Ray cluster answers at", code=1)


def test_generate_prompt_file_errors_are_one_line(tmp_path):
    out = epd("generate", "--addr", NO_SERVER, "--prompt-file", str(tmp_path / "missing.txt"), timeout=60)
    assert_one_line_error(out, "epd generate: error:", "--prompt-file: cannot read", "No such file")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    out = epd("generate", "--addr", NO_SERVER, "--prompt-file", str(tmp_path / "latin1.txt"), timeout=60)
    assert_one_line_error(out, "epd generate: error:", "is not UTF-8 text (byte 3)")
    out = epd("generate", "--addr", NO_SERVER, "--prompt", "x", "--prompt-file", str(tmp_path / "latin1.txt"),
              timeout=60)
    assert_one_line_error(out, "epd generate: error:", "not allowed with argument")


def test_terminal_text_escapes_what_a_terminal_would_obey():
    from control.cli import terminal_text

    answer = "ok\x1b]0;pwned\x07 \x1b[2J\u202eevil\x9b\x7f\nnext\tline é 中"
    shown = terminal_text(answer)
    assert shown == "ok\\x1b]0;pwned\\x07 \\x1b[2J\\u202eevil\\x9b\\x7f\nnext\tline é 中"
    assert not any(ord(c) < 0x20 and c not in "\n\t" for c in shown)
    assert terminal_text("plain text\n") == "plain text\n"


def test_generate_on_a_terminal_escapes_control_characters_of_the_answer():
    """Under a pseudo-terminal the answer goes through terminal_text; into a pipe it is left as it is."""
    import os
    import pty

    from control import cli

    code = ("import sys; from control import cli; "
            "print(repr(cli._shown_on(sys.stdout)('a\\x1b[31mb')))")
    import subprocess
    import sys as _sys

    piped = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert piped.stdout.strip() == repr("a\x1b[31mb"), piped.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([_sys.executable, "-c", code], stdout=follower, stderr=subprocess.PIPE, timeout=60)
        assert proc.returncode == 0, proc.stderr
        text = os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert repr("a\\x1b[31mb") in text, text
    assert cli.terminal_text("\x1b") == "\\x1b"
