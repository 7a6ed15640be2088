"""Runs tests/distributed_prefill_cases.py on XLA:CPU with four host devices: JAX takes the device count from
XLA_FLAGS when it starts, so the cases get a process of their own. Every case must run (none skipped)."""

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("distributed_prefill_cases.py")


def test_distributed_prefill_on_four_host_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(CASES)],
                         cwd=CASES.parent, env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    assert "passed" in summary and "skipped" not in summary, summary
