"""The server's app in this process over a scripted scheduler: the model's output is a text the test chooses, so
that tool calls, failures and a full queue happen on cue. The official openai client talks to the app directly
(httpx's ASGI transport, no socket)."""

import asyncio
import json

import httpx2
import openai
import pytest

from hybridjit.models.registry import config_from_json
from hybridjit.resolve import default_model_dir
from hybridjit.serving.scheduler import Finished, QueueFull, Token
from hybridjit.serving.server import create_app
from hybridjit.tokenizer import load_tokenizer

DEFAULT = default_model_dir()
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TOOL_CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedModel:
    def __init__(self, path):
        self.path, self.config = path, config_from_json(DEFAULT / "config.json")
        self.tokenizer = load_tokenizer(DEFAULT, self.config.bos_token_id)


class ScriptedTicket:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class ScriptedScheduler:
    """The scheduler's interface: every request gets the tokens of `text`, then Finished(reason, error)."""

    def __init__(self, model, text="", reason="stop", error=None, queue_full=False):
        self.model, self.reason, self.error, self.queue_full = model, reason, error, queue_full
        self.tokens = model.tokenizer.encode(text)[1:]  # without the BOS
        self.tickets = []

    def start(self):
        pass

    def submit(self, request, on_event):
        if self.queue_full:
            raise QueueFull(0, retry_after=2.5)
        for token in self.tokens:
            on_event(Token(token))
        on_event(Finished(self.reason, len(request.prompt), len(self.tokens), cached_tokens=3, error=self.error))
        self.tickets.append(ScriptedTicket())
        return self.tickets[-1]

    def stats(self):
        return dict.fromkeys(
            ["queue", "slots", "slots_in_use", "prefix_cache_hits", "prefix_cache_hit_tokens", "prefix_cache_bytes"], 0
        )

    def shutdown(self, timeout=5.0):
        pass


def call(scheduler, request, api_key=None):
    """`await request(client)` against the app of `scheduler`, as the openai client with `api_key` sends it."""

    async def run():
        app = create_app(scheduler, model_name="scripted", api_key=api_key)
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key=api_key or "none", http_client=http, max_retries=0
            )
            return await request(client)

    return asyncio.run(run())


def scripted(text="", path=DEFAULT, **ending):
    return ScriptedScheduler(ScriptedModel(path), text, **ending)


def chat(stream=False, **options):
    async def request(client):
        response = await client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "weather?"}], stream=stream, **options
        )
        return [chunk async for chunk in response] if stream else response

    return request


def assembled(chunks):
    """A streamed chat's content, tool calls (OpenAI's delta format: pieces by index) and finish reason."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, list(calls.values()), finish_reason


def test_tool_calls_in_the_output_come_back_as_tool_calls():
    response = call(scripted(TOOL_CALL_TEXT), chat(tools=[WEATHER_TOOL]))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    [tool_call] = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_calls_come_as_tool_call_deltas_after_the_content():
    chunks = call(scripted(TOOL_CALL_TEXT), chat(stream=True, tools=[WEATHER_TOOL]))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls, finish_reason = assembled(chunks)
    assert content == "Checking.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    assert finish_reason == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_text_is_content():
    for options in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}):
        choice = call(scripted(TOOL_CALL_TEXT), chat(**options)).choices[0]
        message = choice.message
        assert (message.content, message.tool_calls, choice.finish_reason) == (TOOL_CALL_TEXT, None, "stop")


def test_fields_we_do_not_implement_are_taken_at_their_neutral_values():
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
               "response_format": {"type": "text"}}  # fmt: skip
    assert call(scripted("Sunny."), chat(**neutral)).choices[0].message.content == "Sunny."
    # an assistant's tool calls go without content
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip

    async def request(client):
        return await client.chat.completions.create(model="scripted", messages=history, tools=[WEATHER_TOOL])

    assert call(scripted("Sunny."), request).choices[0].message.content == "Sunny."


def test_a_stop_string_ends_the_text_before_it_and_cancels_the_request():
    scheduler = scripted("x = 1\nSTOP here")
    for stream in (False, True):
        response = call(scheduler, chat(stream=stream, stop=["STOP"]))
        content, _, finish_reason = assembled(response) if stream else (response.choices[0].message.content, 0, 0)
        assert content == "x = 1\n"
        assert (finish_reason if stream else response.choices[0].finish_reason) == "stop"
        assert scheduler.tickets[-1].cancelled


def test_usage_reports_cached_prompt_tokens():
    usage = call(scripted("abc", reason="length"), chat(max_tokens=2)).usage
    assert usage.prompt_tokens_details.cached_tokens == 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_failed_request_is_a_500_and_the_server_goes_on():
    failing = scripted("partial", reason="error", error="RuntimeError: CPU expert job failed")
    with pytest.raises(openai.InternalServerError, match="CPU expert job failed"):
        call(failing, chat())
    failing.reason = "stop"
    assert call(failing, chat()).choices[0].message.content == "partial"


def test_a_request_that_fails_mid_stream_ends_with_an_error_event():
    failing = scripted("partial", reason="error", error="RuntimeError: CPU expert job failed")
    with pytest.raises(openai.APIError, match="CPU expert job failed"):
        call(failing, chat(stream=True))


def test_a_full_queue_is_a_429_with_retry_after():
    with pytest.raises(openai.RateLimitError) as caught:
        call(scripted(queue_full=True), chat())
    assert caught.value.status_code == 429
    assert caught.value.response.headers["Retry-After"] == "3"  # 2.5 s, in the whole seconds HTTP allows


def test_the_api_key_is_required_when_set():
    scheduler = scripted("ok")
    assert call(scheduler, chat(), api_key="sesame").choices[0].message.content == "ok"

    async def wrong_key(client):
        return await client.with_options(api_key="guess").chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}]
        )

    with pytest.raises(openai.AuthenticationError, match="API key"):
        call(scheduler, wrong_key, api_key="sesame")


def test_a_checkpoint_without_a_chat_template_answers_completions_but_not_chat(tmp_path):
    scheduler = scripted("pass", path=tmp_path)
    with pytest.raises(openai.BadRequestError, match="no chat template") as caught:
        call(scheduler, chat())
    assert caught.value.body["param"] == "messages"

    async def completion(client):
        return await client.completions.create(model="scripted", prompt="def f():")

    assert call(scheduler, completion).choices[0].text == "pass"
