"""Chat templates and tool-call parsing (hybridjit.serving.chat): pure functions of their text."""

import json

import pytest

from hybridjit.resolve import default_model_dir
from hybridjit.serving.chat import DEEPSEEK, HERMES, ChatTemplate, ChatTemplateError, ToolCall, ToolCallStream

WEATHER_ARGS = {"location": "Tokyo", "unit": "celsius"}

DEEPSEEK_V3_TEXT = (
    "Let me check both.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"location": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'get_time\n```json\n{"zone": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31_TEXT = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"location": "Tokyo", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
HERMES_TEXT = (
    'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>'
)


def test_deepseek_v3_tool_calls():
    content, calls = DEEPSEEK.parse(DEEPSEEK_V3_TEXT)
    assert content == "Let me check both.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [WEATHER_ARGS, {"zone": "Asia/Tokyo"}]


def test_deepseek_v31_tool_calls():
    content, calls = DEEPSEEK.parse(DEEPSEEK_V31_TEXT)
    assert content == ""
    assert calls == [ToolCall("get_weather", '{"location": "Tokyo", "unit": "celsius"}')]


def test_hermes_tool_calls():
    content, calls = HERMES.parse(HERMES_TEXT)
    assert content == "I will look it up.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [WEATHER_ARGS, {"zone": "Asia/Tokyo"}]


def test_a_hermes_call_cut_short_of_its_closing_tag_still_parses():
    _, calls = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert calls == [ToolCall("f", '{"x": 1}')]


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x",  # no tool call
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        "<tool_call>\n[1, 2]\n</tool_call>",
    ],
)
def test_text_without_well_formed_hermes_calls_is_all_content(text):
    assert HERMES.parse(text) == (text, [])


def test_deepseek_marker_without_calls_is_content():
    text = "<｜tool▁calls▁begin｜>nothing here"
    assert DEEPSEEK.parse(text) == (text, [])


@pytest.mark.parametrize("tool_format, text", [(DEEPSEEK, DEEPSEEK_V3_TEXT), (HERMES, HERMES_TEXT)])
def test_streamed_content_stops_at_the_tool_calls_which_come_whole_at_the_end(tool_format, text):
    stream = ToolCallStream(tool_format)
    shown = "".join(stream.push(ch) for ch in text)  # one character at a time: markers arrive in pieces
    rest, calls = stream.finish()
    expected_content, expected_calls = tool_format.parse(text)
    assert shown + rest == expected_content
    assert calls == expected_calls and len(calls) == 2


def test_streamed_text_that_only_begins_like_a_marker_is_shown_at_the_end():
    stream = ToolCallStream(HERMES)
    assert stream.push("x = a <tool") == "x = a "  # "<tool" may still become "<tool_call>"
    assert stream.push("s> b") == "<tools> b"
    assert stream.push(" <tool_") == " "
    assert stream.finish() == ("<tool_", [])


def test_the_embedded_model_has_a_chat_template_that_shows_tools_and_messages():
    template = ChatTemplate.of_checkpoint(default_model_dir())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "a <stack> & queue"}]
    prompt = template.render(messages, tools)
    assert prompt.startswith("<|begin_of_text|>") and prompt.endswith("# assistant:")
    assert "# user: a <stack> & queue\n" in prompt  # tojson and text: no HTML escaping, as in transformers
    assert json.dumps(tools[0]) in prompt
    assert template.tool_call_format is HERMES


def write_checkpoint_config(directory, **settings):
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, **settings}))
    return directory


def test_transformers_settings_trimmed_blocks_and_helpers(tmp_path):
    source = (
        "{% for m in messages %}\n"
        "  {{ bos_token }}{{ m.content | tojson }}{% if loop.last %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y') | length }}"
    )
    template = ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path, chat_template=source))
    # What transformers 5.23 renders: trim_blocks drops the newline after a block tag, lstrip_blocks the indent
    # before one (not before an expression); loop controls; bos_token from an AddedToken; tojson keeps é and <.
    assert template.render([{"role": "user", "content": "é<"}]) == '  <s>"é<"4'


def test_raise_exception_in_a_template_is_the_requests_fault(tmp_path):
    source = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('conversations must start with the user') }}{% endif %}"
    )
    template = ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path, chat_template=source))
    with pytest.raises(ChatTemplateError, match="conversations must start with the user"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_templates_run_sandboxed(tmp_path):
    source = "{{ messages.__class__.__mro__ }}"
    template = ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path, chat_template=source))
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    write_checkpoint_config(tmp_path, chat_template="from the config")
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert ChatTemplate.of_checkpoint(tmp_path).render([]) == "from the file"


def test_named_templates_use_tool_use_for_requests_with_tools(tmp_path):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
    template = ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path, chat_template=named))
    assert template.render([]) == "plain"
    assert template.render([], [{"type": "function", "function": {"name": "f"}}]) == "tools: 1"


def test_a_checkpoint_without_a_template_has_none(tmp_path):
    assert ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path)) is None


def test_a_template_that_is_not_jinja_fails_at_load_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_config.json: the chat template is not valid Jinja"):
        ChatTemplate.of_checkpoint(write_checkpoint_config(tmp_path, chat_template="{% for %}"))
