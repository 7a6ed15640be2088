"""The `hybridjit` command as a process: Ctrl-C, a reader that goes away early, argv bytes that are not UTF-8,
and a server that cannot start. Each ends with one line on stderr (or none) and a conventional exit status, never
a traceback."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import free_port

ROOT = Path(__file__).resolve().parents[1]
LONG_RUN = ["generate", "--max-new-tokens", "2000", "def fibonacci(n):"]  # seconds of output on a CPU


@contextlib.contextmanager
def hybridjit(*argv, env: dict | None = None):
    """`python -m hybridjit ...` of this source tree, with pipes (and `env` added to the environment); killed if the
    test leaves it running."""
    # A child inherits an ignored SIGINT (a shell's background job) but not a handler: while it starts, the
    # handler is set, so that the child's Python raises KeyboardInterrupt on SIGINT as it does in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridjit", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_ends_with_one_line_and_status_130():
    with hybridjit(*LONG_RUN) as proc:
        streamed = proc.stdout.readline() + proc.stdout.readline()  # generation is under way
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert b"Traceback" not in err and err.decode().splitlines()[-1] == "hybridjit: error: interrupted"
    assert streamed == b'\n    """\n'  # what was streamed before the interrupt stays


def test_a_closed_stdout_ends_quietly_with_status_141():
    with hybridjit(*LONG_RUN) as proc:
        proc.stdout.read(1)
        proc.stdout.close()  # `| head -c 1`
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141
    assert b"Traceback" not in err and b"error" not in err


@pytest.mark.parametrize(
    "argv, argument", [([b"caf\xe9"], "prompt"), ([b"--stop", b"\xff", b"def f("], "--stop")], ids=["prompt", "stop"]
)
def test_argv_bytes_that_are_not_utf8_are_a_usage_error(argv, argument):
    with hybridjit("generate", *argv) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert b"Traceback" not in err
    assert err.decode().splitlines()[-1] == f"hybridjit generate: error: argument {argument}: not valid UTF-8 text"


def test_serve_refuses_a_cache_longer_than_the_context_in_one_line():
    with hybridjit("serve", "--quiet", "--cache-len", "99999", "--port", str(free_port())) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.decode().splitlines()[-1] == "hybridjit: error: cache_len must be in [1, 2048], got 99999"


def test_serve_refuses_disaggregation_on_one_device_in_one_line():
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"}  # on a host with several; nothing changes on a CPU
    with hybridjit("serve", "--quiet", "--disaggregate", "always", "--port", str(free_port()), env=one_gpu) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.decode().splitlines()[-1] == ("hybridjit: error: disaggregate='always': the placement has no prefill "
                                             "device besides the one that decodes")


def test_serve_on_a_port_in_use_says_so_in_one_line_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with hybridjit("serve", "--port", str(port)) as proc:
            _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    message = f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"
    assert err.decode() == f"hybridjit: error: {message}\n"
