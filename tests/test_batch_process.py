"""`hybridjit batch` as a process: killed in the middle of a run (SIGKILL: no handler, no cleanup) and started
again, it loses no request, runs none twice and leaves no torn line; bad input is one error of status 2."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
# 2 slots and 12 requests: six waves of completions, so a kill after the first line lands mid-run.
REQUESTS = [{"id": f"q{i}", "prompt": CODE[: 4 + 5 * i], "max_tokens": 24} for i in range(12)]
ARGS = ["--quiet", "--temperature", "0", "--slots", "2", "--micro-batches", "1", "--prefill-batch", "2"]


def batch_process(source: Path, out: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hybridjit", "batch", str(source), str(out), *ARGS, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_killed_and_restarted_it_loses_nothing_and_repeats_nothing(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    proc = batch_process(source, out)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "no line written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    first_run = out.read_text().splitlines()
    assert 1 <= len(first_run) < len(REQUESTS), "the kill did not land mid-run"
    with open(out, "a") as f:  # a crash in the middle of a write: the line's start without its end
        f.write('{"id": "q11", "text": "tor')

    proc = batch_process(source, out)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()
    lines = out.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line whole
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in REQUESTS)  # none lost, none twice
    assert lines[: len(first_run)] == first_run  # what was written stays as it was

    # Nothing left to do: the third run writes nothing.
    proc = batch_process(source, out)
    proc.communicate(timeout=240)
    assert proc.returncode == 0 and out.read_text().splitlines() == lines


def test_bad_input_is_one_error_of_status_2(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "x", "top_p": 0}\n')
    proc = batch_process(source, tmp_path / "out.jsonl")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and b"Traceback" not in err
    assert err.decode().splitlines() == [
        f"hybridjit: error: {source}: 1 bad line, nothing was run:",
        "  line 1: top_p: Input should be greater than 0",
    ]


def test_a_choice_the_model_cannot_take_is_one_error_of_status_2(tmp_path):
    """--kv-in-host reaches the policy, which names what it needs: the embedded model on the CPU has no experts
    pinned for streaming."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "x"}\n')
    proc = batch_process(source, tmp_path / "out.jsonl", "--kv-in-host")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and b"Traceback" not in err
    assert "hybridjit: error: kv_in_host=True: the KV cache in host memory is read by decode steps that stream" in (
        err.decode()
    )
