"""Runs tests/distributed_prefill_cases.py on XLA:CPU with four host devices: JAX takes the device count from
XLA_FLAGS when it starts, so the cases get a process of their own. Every case selected must run (none skipped).

To keep CI short the selection is MLA over two devices through the scheduler (a disaggregated prefill, then the
same prompt over both devices, its tokens split between them, each decoding from its streamed cache to its solo
tokens; a disaggregated prefill cancelled, and one under shutdown; a prefill apart with the decoding device's share
staged through it and not) and gpt-oss (MXFP4, biases, sinks, window; skewed
routing) over two, its batch of two prompts split between them, with the whole-layer ring, plus the split attention
cores and the uneven split; the whole module (every family case over two and four devices, ring of one) runs with
`pytest tests/distributed_prefill_cases.py` under the same XLA_FLAGS (about 20 minutes on two cores) and on a
machine with several GPUs."""

import os
import subprocess
import sys
from pathlib import Path

from hybridjit.placement import even_share

CASES = Path(__file__).with_name("distributed_prefill_cases.py")


def test_distributed_prefill_on_four_host_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    selection = ("heads_split or split_evenly "
                 "or (deepseek_v3 and 2-devices and (disaggregat or pinned_through or copied_once or stages_the)) "
                 "or (gpt_oss and 2-devices and not ring-of-1 and not decode and not disaggregat)")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", selection,
                          str(CASES)],
                         cwd=CASES.parent, env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    assert "passed" in summary and "skipped" not in summary, summary


def test_default_prefill_devices_split_the_experts_evenly():
    assert even_share("b", ["a", "b", "c"], 256) == ("b", "a")  # the decoding device first; 256 % 3 != 0
    assert even_share("a", ["a", "b", "c", "d"], 256) == ("a", "b", "c", "d")
    assert even_share("a", ["a", "b", "c"], 384) == ("a", "b", "c")
    assert even_share("a", ["a"], 7) == ("a",)
