"""`hybridjit serve` as a process with the embedded model, through the official openai client and raw HTTP:
completions and chat, streamed and not, equal to the model's own greedy `generate`; bad input; clients that
leave mid-stream; many clients at once, and a bounded soak."""

import itertools
import json
import random
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import httpx
import pytest
from server_process import serve

from hybridjit.resolve import default_model_dir
from hybridjit.serving.chat import ChatTemplate
from hybridjit.tokenizer import load_tokenizer

# Short prompts (8 tokens at most) and lengths that keep prompt + completion within 16 tokens: the requests run
# the same few compiled programs (their shapes are bucketed), and compiling is most of this module's time.
PROMPTS = ["def f(x):", "class A:", "import os\n", "for i in x:", "x = [1, 2]", "def main():", "if x:\n", "while True:"]
LENGTHS = (5, 6, 8)
MESSAGES = [{"role": "user", "content": "add"}]
TOOLS = [{"type": "function", "function": {"name": "add"}}]
CONTEXT = 2048
TOKENIZER = load_tokenizer(default_model_dir(), bos_token_id=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("server"), "--slots", "4") as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """The solo greedy generate of a prompt (text) for max_new_tokens, computed here, in the test process."""
    import hybridjit

    model = hybridjit.load()
    return cache(lambda prompt, max_tokens: model.generate(prompt, max_new_tokens=max_tokens))


@pytest.fixture(scope="module")
def template():
    return ChatTemplate.of_checkpoint(default_model_dir())


def completion(server, prompt, max_tokens, **options):
    return server.client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, **options
    )


def test_models_lists_the_served_model(server):
    [model] = server.client.models.list().data
    assert model.id == "default" and model.owned_by == "hybridjit"


def test_a_json_body_sent_as_a_form_is_read_as_json(server, reference):
    """`curl -d '{...}'`, the README's example, declares application/x-www-form-urlencoded."""
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    response = server.post("/v1/completions", content=body, headers=form)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == reference(PROMPTS[0], 8)


def test_a_completion_equals_generate(server, reference):
    response = completion(server, PROMPTS[0], 8)
    assert response.object == "text_completion"
    assert response.choices[0].text == reference(PROMPTS[0], 8)
    assert response.choices[0].finish_reason == "length"
    usage = response.usage
    prompt_tokens = len(TOKENIZER.encode(PROMPTS[0]))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 8, prompt_tokens + 8)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_a_streamed_completion_equals_generate(server, reference):
    chunks = list(completion(server, PROMPTS[1], 8, stream=True, stream_options={"include_usage": True}))
    assert {chunk.object for chunk in chunks} == {"text_completion"}
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == reference(PROMPTS[1], 8)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_a_stop_string_ends_the_completion_before_it(server, reference):
    full = reference(PROMPTS[0], 8)
    stop = full[6:9]
    response = completion(server, PROMPTS[0], 8, stop=[stop, "never in the text"])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_a_token_id_prompt(server, reference):
    assert completion(server, TOKENIZER.encode(PROMPTS[2]), 8).choices[0].text == reference(PROMPTS[2], 8)


# With tools the prompt is long: one token only, which needs no decode program of that size.
@pytest.mark.parametrize("tools, max_tokens", [(None, 5), (TOOLS, 1)], ids=["plain", "tools"])
def test_chat_renders_the_template_and_equals_generate(server, reference, template, tools, max_tokens):
    prompt = template.render(MESSAGES, tools)
    options = {"tools": tools} if tools else {}
    response = server.client.chat.completions.create(
        model="default", messages=MESSAGES, max_completion_tokens=max_tokens, temperature=0, **options
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference(prompt, max_tokens)
    # the tools reached the template: the prompt is the one rendered with them
    assert response.usage.prompt_tokens == len(TOKENIZER.encode(prompt))


def test_a_streamed_chat_equals_generate(server, reference, template):
    stream = server.client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == reference(template.render(MESSAGES), 5)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


LONG_IDS = [5] * (CONTEXT + 1)
BAD_REQUESTS = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": LONG_IDS}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "pass\n" * CONTEXT}]}, "messages"),
    # JSON's escape of a lone surrogate is no text: no tokenizer takes it, no reply could carry it back
    ("/v1/completions", {"prompt": "a\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "reasoning": "\ud800"}]}, "messages"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    # what we do not implement is refused, not ignored
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = server.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert (param or "JSON") in error["message"]


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    before = server.metrics()
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: {")
    # The request ends as cancelled, long before its 1000 tokens, and its slot is free again.
    cancelled = 'hybridjit_requests_total{finish_reason="cancelled"}'
    server.wait_for(
        lambda m: m.get(cancelled, 0) == before.get(cancelled, 0) + 1 and m["hybridjit_slots_in_use"] == 0,
        "the cancellation",
    )
    generated = server.metrics()["hybridjit_generation_tokens_total"] - before["hybridjit_generation_tokens_total"]
    assert 1 <= generated < 1000


def run_request(server, prompt, max_tokens, stream):
    if not stream:
        return completion(server, prompt, max_tokens).choices[0].text
    return "".join(chunk.choices[0].text for chunk in completion(server, prompt, max_tokens, stream=True))


def test_concurrent_clients_each_get_their_own_greedy_completion(server, reference):
    cases = [(prompt, 8, i % 2 == 1) for i, prompt in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(lambda case: run_request(server, *case), cases))
    assert texts == [reference(prompt, max_tokens) for prompt, max_tokens, _ in cases]


def abandon_stream(server, prompt):
    """A streamed request whose client closes the connection after its first chunk."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: {")


def test_soak_loses_mixes_and_leaks_nothing(server, reference):
    """200 requests from 16 clients, mixed prompts and lengths, streamed or not, one in seven abandoned
    mid-stream: every other one gets exactly its solo greedy completion; in the end every request has
    ended, no slot is held and the server's memory has not grown."""
    cases = list(itertools.product(PROMPTS, LENGTHS))
    for prompt, max_tokens in cases:  # the references, and the server's programs for these shapes compiled
        assert run_request(server, prompt, max_tokens, stream=False) == reference(prompt, max_tokens)
    server.wait_for(lambda m: m["hybridjit_slots_in_use"] == 0, "the warm-up's end")
    rss_before, before = server.rss_bytes(), server.metrics()

    rng = random.Random(0)
    work = [(*rng.choice(cases), rng.random() < 0.5, i % 7 == 3) for i in range(200)]

    def run(case):
        prompt, max_tokens, stream, abandon = case
        if abandon:
            return abandon_stream(server, prompt)
        return run_request(server, prompt, max_tokens, stream)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, work))
    mixed_or_lost = [case for case, text in zip(work, results, strict=True)
                     if not case[3] and text != reference(*case[:2])]  # fmt: skip
    assert mixed_or_lost == []

    def ended(m):
        return sum(v for k, v in m.items() if k.startswith("hybridjit_requests_total")) - sum(
            v for k, v in before.items() if k.startswith("hybridjit_requests_total")
        )

    server.wait_for(
        lambda m: ended(m) == len(work) and m["hybridjit_slots_in_use"] == 0 and m["hybridjit_queue_length"] == 0,
        "the end of every request",
    )
    assert server.rss_bytes() - rss_before < 128 * 2**20
