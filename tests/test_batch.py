"""`hybridjit.batch`, the offline throughput mode, in process on the embedded model: every request gets what
`generate` gives it alone, whatever policy runs it (each forced here); bad lines are all listed before anything
runs; an output file is resumed, its torn last line dropped and its done ids skipped."""

import contextlib
import dataclasses
import json
import os

import jax
import pytest

import hybridjit
from hybridjit.offline_policy import HOST_LOOP_CPUS, RESIDENT, choose_policy, co_execution_threads
from hybridjit.ops.routed_experts import kernel_info
from hybridjit.placement import Placement
from hybridjit.resolve import default_model_dir
from hybridjit.serving import batch as batch_module
from hybridjit.serving.batch_output import ResumableOutput
from hybridjit.serving.batch_requests import BatchInputError, encode_requests, read_requests
from hybridjit.serving.chat import ChatTemplate

CODE = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
# Mixed lengths (1 to 35 tokens) and budgets: slots free up at different steps and are refilled mid-run.
REQUESTS = [{"id": f"r{i}", "prompt": CODE[: 3 + 7 * i], "max_tokens": 4 + 3 * (i % 4)} for i in range(9)]
# (slots, micro_batches, prefill_batch): coalesced experts over 1, 2, 3 attention micro-batches, and the dual
# overlap; prefill batches of 1 (alone, as generate) to more than the free slots.
POLICIES = [(3, 1, 2), (4, 2, 4), (5, 3, 3), (4, "dual", 1)]


@pytest.fixture(scope="module")
def model():
    """On the CPU in float32 wherever the tests run: the comparison with generate is exact there (as in
    test_scheduler.py)."""
    m = hybridjit.load(placement=Placement.default("float32", jax.devices("cpu")[0]))
    yield m
    m.close()


def alone(model, prompt, max_tokens, **options) -> str:
    return model.generate(prompt, max_new_tokens=max_tokens, temperature=0, **options)


def run(model, requests, output=None, **options):
    return hybridjit.batch(model, requests, output, temperature=0, progress=False, **options)


@pytest.mark.parametrize("slots, micro_batches, prefill_batch", POLICIES)
def test_greedy_outputs_equal_generate_whatever_the_policy(model, slots, micro_batches, prefill_batch):
    records = run(model, REQUESTS, slots=slots, micro_batches=micro_batches, prefill_batch=prefill_batch)
    assert [r["id"] for r in records] == [r["id"] for r in REQUESTS]
    for request, record in zip(REQUESTS, records, strict=True):
        assert record["text"] == alone(model, request["prompt"], request["max_tokens"]), request["id"]
        assert record["token_ids"] == model.generate(model.tokenizer.encode(request["prompt"]),
                                                     max_new_tokens=request["max_tokens"])[: len(record["token_ids"])]
        assert record["prompt_tokens"] == len(model.tokenizer.encode(request["prompt"]))
        assert record["completion_tokens"] == len(record["token_ids"])
        assert record["finish_reason"] == ("length" if record["completion_tokens"] == request["max_tokens"] else "stop")


@pytest.mark.parametrize("cpu_blocks", [0, 3])
def test_greedy_outputs_equal_generate_with_the_experts_streamed_each_step(model, cpu_blocks, monkeypatch):
    """The policy that streams the routed experts to the device each decode step (here the CPU device: the same
    program as on a GPU), with or without 3 of each layer's 8 blocks on the CPU kernels meanwhile (co-execution),
    gives every request what generate gives it alone. Co-executing, the run's CPU pool leaves the host's loop its
    CPUs (offline_policy.co_execution_threads), and is as it was afterwards."""
    before, during = kernel_info()["threads"], []
    decode_all = batch_module._decode_all
    monkeypatch.setattr(batch_module, "_decode_all",
                        lambda *a: (during.append(kernel_info()["threads"]), decode_all(*a)))
    placement = dataclasses.replace(model.placement, pinned_experts=True)
    with contextlib.closing(hybridjit.load(placement=placement)) as pinned:
        records = run(pinned, REQUESTS[:5], slots=3, prefill_batch=2, experts="stream", cpu_blocks=cpu_blocks)
    for request, record in zip(REQUESTS, records, strict=False):
        assert record["text"] == alone(model, request["prompt"], request["max_tokens"]), request["id"]
    assert during == [co_execution_threads() if cpu_blocks else before]
    assert co_execution_threads() == max(1, min(before, len(os.sched_getaffinity(0)) - HOST_LOOP_CPUS))
    assert kernel_info()["threads"] == before


def test_greedy_outputs_equal_generate_with_the_kv_cache_in_host_memory(model):
    """Streamed decode steps with the KV cache in pinned host memory (each layer's cache copied to the device for its
    attention, the step's entries written back, slots refilled mid-run), or attended over there by the CPU, give every
    request what generate gives it alone. The cache in host memory is for streamed steps only: asked with the CPU's
    experts it is a clear error."""
    placement = dataclasses.replace(model.placement, pinned_experts=True)
    with contextlib.closing(hybridjit.load(placement=placement)) as pinned:
        jobs = encode_requests(pinned, read_requests([("l", json.dumps(r)) for r in REQUESTS], "requests", {}),
                               "requests")  # fmt: skip
        policy = choose_policy(pinned, jobs, 64, slots=3, prefill_batch=2, kv_in_host=True)
        assert policy.experts == "stream" and policy.kv_in_host and "KV cache in host memory" in policy.describe()
        records = run(pinned, REQUESTS, slots=3, prefill_batch=2, kv_in_host=True, cpu_blocks=2)
        on_cpu = run(pinned, REQUESTS[:5], slots=3, prefill_batch=2, attention_on_cpu=True)
        with pytest.raises(ValueError, match="kv_in_host=True: the KV cache in host memory is read by streamed"):
            run(pinned, REQUESTS[:1], experts="cpu", kv_in_host=True)
    for request, record in zip(REQUESTS, records, strict=True):
        assert record["text"] == alone(model, request["prompt"], request["max_tokens"]), request["id"]
    for request, record in zip(REQUESTS, on_cpu, strict=False):  # the CPU attending over the cache there
        assert record["text"] == alone(model, request["prompt"], request["max_tokens"]), request["id"]


def test_a_model_with_every_expert_resident_is_run_with_them_on_the_device(model):
    """Where every routed expert is resident on the device (auto placement, when they fit), the policy runs them there
    (experts "gpu"; not dual-batch overlap, which overlaps the CPU's experts with the GPU) and prices them so; every
    request still gets what generate gives it alone. A choice of where the experts run is then a clear error."""
    placement = dataclasses.replace(model.placement, resident_experts="auto")
    with contextlib.closing(hybridjit.load(placement=placement)) as resident:
        assert not resident.experts_on_host
        policy = choose_policy(resident, encode_requests(resident, read_requests(
            [("l", json.dumps(r)) for r in REQUESTS[:4]], "requests", {}), "requests"), 64)  # fmt: skip
        assert policy.experts == RESIDENT and policy.micro_batches != "dual" and not policy.cpu_blocks
        assert "routed experts resident on the GPU" in policy.describe()
        records = run(resident, REQUESTS[:4], slots=3, prefill_batch=2)
        for request, record in zip(REQUESTS, records, strict=False):
            assert record["text"] == alone(model, request["prompt"], request["max_tokens"]), request["id"]
        with pytest.raises(ValueError, match="experts='cpu': every routed expert of this model is resident"):
            run(resident, REQUESTS[:1], experts="cpu")


def test_resident_fp8_experts_held_dequantized_for_a_run_give_the_same_outputs_and_are_stored_again():
    """The FP8 embedded model with every expert resident: a run that holds the copies dequantized (the policy's
    `widened`, forced) gives every request what generate gives it with the copies as stored, and the model holds
    them as stored again afterwards."""
    placement = dataclasses.replace(Placement.default("float32", jax.devices("cpu")[0]), resident_experts="auto")
    with contextlib.closing(hybridjit.load(default_model_dir().parent / "default-fp8", placement=placement)) as fp8:
        assert not fp8.experts_on_host and not fp8.resident_widened
        records = run(fp8, REQUESTS[:4], slots=3, prefill_batch=2, widened=True)
        assert not fp8.resident_widened
        for request, record in zip(REQUESTS, records, strict=False):
            assert record["text"] == alone(fp8, request["prompt"], request["max_tokens"]), request["id"]


def test_chat_token_ids_and_stop_strings(model):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    requests = [
        {"id": 0, "messages": messages, "max_tokens": 6},
        {"id": "ids", "prompt": [5, 17, 42, 99], "max_tokens": 5},
        {"id": "stop", "prompt": CODE[:20], "max_tokens": 12, "stop": ["\n"]},
    ]
    chat, ids, stopped = run(model, requests, slots=3, micro_batches=1, prefill_batch=3)
    rendered = ChatTemplate.of_model(model).render(messages)
    assert chat["text"] == alone(model, rendered, 6) and chat["id"] == 0
    assert ids["token_ids"] == model.generate([5, 17, 42, 99], max_new_tokens=5)
    assert stopped["text"] == alone(model, CODE[:20], 12, stop=["\n"])
    assert stopped["finish_reason"] == "stop" and "\n" not in stopped["text"]


def test_sampling_depends_on_the_request_not_on_the_policy(model):
    requests = [{"id": i, "prompt": CODE[: 5 + i], "temperature": 1.0, "max_tokens": 6} for i in range(4)]
    first = run(model, requests, slots=2, micro_batches=1, prefill_batch=1)
    again = run(model, requests, slots=4, micro_batches=2, prefill_batch=4)
    assert first == again
    assert len({r["text"] for r in first}) > 1  # seeds derived from the ids: the requests draw apart


def test_bad_lines_are_all_listed_with_line_and_field_before_anything_runs(model, tmp_path):
    lines = [
        {"id": "a", "prompt": "x", "temperature": 5},
        {"id": "a", "prompt": "y"},
        {"prompt": "no id"},
        {"id": "b", "prompt": "x", "messages": []},
        {"id": "c", "prompt": "x", "max_tokens": 0},
        {"id": "d", "prompt": "x\ud800"},  # json.dumps writes the escape; no tokenizer or UTF-8 writer takes it
        {"id": "\udc00", "prompt": "x"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(map(json.dumps, lines)) + "\n\nnot json\n")
    with pytest.raises(BatchInputError) as error:
        run(model, source, tmp_path / "out.jsonl")
    assert str(error.value).splitlines() == [
        f"{source}: 8 bad lines, nothing was run:",
        "  line 1: temperature: Input should be less than or equal to 2",
        "  line 2: id: 'a' repeats the id of line 1",
        "  line 3: id: Field required",
        "  line 4: needs exactly one of prompt (text or token ids) and messages (a chat)",
        "  line 5: max_tokens: Input should be greater than or equal to 1",
        "  line 6: prompt: not valid Unicode: a lone surrogate \\ud800 at character 1",
        "  line 7: id: not valid Unicode: a lone surrogate \\udc00 at character 0",
        "  line 9: not valid JSON (Expecting value: line 1 column 1 (char 0))",
    ]
    assert not (tmp_path / "out.jsonl").exists()


def test_requests_the_model_cannot_take_are_listed_before_anything_runs(model, tmp_path):
    requests = [{"id": 1, "prompt": [0, 99999]}, {"id": 2, "prompt": "x", "max_tokens": 5000}, {"id": 3, "prompt": "x"}]
    with pytest.raises(BatchInputError) as error:
        run(model, requests, tmp_path / "out.jsonl")
    assert str(error.value).splitlines() == [
        "requests: 2 bad lines, nothing was run:",
        "  request 0: prompt: token id 99999 is outside the vocabulary [0, 2048)",
        "  request 1: max_tokens: the prompt's 2 tokens + max_tokens 5000 exceed the model's context of 2048",
    ]
    assert not (tmp_path / "out.jsonl").exists()


def test_a_rerun_skips_done_ids_and_drops_a_torn_last_line(model, tmp_path):
    out = tmp_path / "out.jsonl"
    done = {"id": "r1", "text": "written by the first run", "token_ids": [], "prompt_tokens": 0,
            "completion_tokens": 0, "finish_reason": "length"}  # fmt: skip
    out.write_text(json.dumps(done) + "\n" + '{"id": "r2", "text": "cut sh')  # killed in the middle of a line
    records = run(model, REQUESTS[:4], out, slots=3, micro_batches=1, prefill_batch=2)
    assert records[1] == done  # not run again
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == ["r0", "r1", "r2", "r3"]
    assert {r["id"]: r for r in lines} == {r["id"]: r for r in records}
    assert run(model, REQUESTS[:4], out) == records  # all done: nothing runs, the records come from the file


def test_an_output_file_of_something_else_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=f"{out} line 2: not an output line of hybridjit batch"):
        ResumableOutput(out)


def test_an_input_that_is_not_a_file_is_named_before_the_model_loads(tmp_path):
    for path, what in ((tmp_path, "is a directory"), (tmp_path / "none.jsonl", "no such file")):
        with pytest.raises(FileNotFoundError, match=f"^{path}: {what}; the input is a JSONL file$"):
            hybridjit.batch("no-such-model", path, tmp_path / "out.jsonl")
