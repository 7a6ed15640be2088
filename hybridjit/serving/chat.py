"""Chat: the checkpoint's own chat template, rendered as transformers renders it, and the tool calls in a
model's output, parsed into OpenAI's `tool_calls`.

Templates come with checkpoints from anywhere, so they run in jinja2's immutable sandbox, with the same
settings and helpers that transformers gives them (transformers/utils/chat_template_utils.py): a template
written for transformers renders the same prompt here.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridjit.tokenizer import first_stop, read_json, stop_prefix_length

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # those transformers passes the template


class ChatTemplateError(ValueError):
    """The template cannot render these messages (it raised, or it failed): the request's fault."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as in OpenAI's function.arguments


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls: all of them follow a start marker, after any content."""

    name: str
    start: str
    parse_calls: Callable[[str], list[ToolCall] | None]  # the text from `start` on -> its calls; None: malformed

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content (the text before the tool calls) and the calls. Text whose calls do not parse is all
        content, as the model wrote it."""
        start = text.find(self.start)
        calls = self.parse_calls(text[start:]) if start >= 0 else None
        return (text[:start], calls) if calls else (text, [])


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
# DeepSeek-V3 / R1 write the type before the separator and the arguments in a json code block after the name.
_DEEPSEEK_V3_BODY = re.compile(r"([^\n]*)\n```(?:json)?\n(.*?)\n?```\s*", re.DOTALL)


def _deepseek_calls(text: str) -> list[ToolCall] | None:
    """DeepSeek-V3 / R1: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>;
    DeepSeek-V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>. Several follow each other
    between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>."""
    calls = []
    for head, body in _DEEPSEEK_CALL.findall(text):
        if v3 := _DEEPSEEK_V3_BODY.fullmatch(body):
            calls.append(ToolCall(v3[1].strip(), v3[2].strip()))
        else:
            calls.append(ToolCall(head.strip(), body.strip()))
    return calls or None


# The last call may be cut short of its closing tag when the model ends right after the JSON.
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes_calls(text: str) -> list[ToolCall] | None:
    """Qwen3 / Hermes: <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>, one block per call."""
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else _json(arguments)))
    return calls or None


DEEPSEEK = ToolCallFormat("deepseek", "<｜tool▁calls▁begin｜>", _deepseek_calls)
HERMES = ToolCallFormat("hermes", "<tool_call>", _hermes_calls)
TOOL_CALL_FORMATS = (DEEPSEEK, HERMES)


def tool_call_format(template: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model: the one whose start marker the template writes."""
    return next((f for f in TOOL_CALL_FORMATS if f.start in template), None)


class ToolCallStream:
    """A chat's content as it streams, holding back its tool calls: text from the start marker on (and a tail
    that may still become the marker) waits for `finish`, which parses it."""

    def __init__(self, tool_format: ToolCallFormat):
        self.format = tool_format
        self.text = ""
        self.emitted = 0

    def push(self, delta: str) -> str:
        """The content that `delta` completes: what can be shown now."""
        self.text += delta
        start = first_stop(self.text, [self.format.start])
        end = len(self.text) - stop_prefix_length(self.text, [self.format.start]) if start is None else start
        content = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return content

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not shown yet, and the tool calls, once generation has ended."""
        content, calls = self.format.parse(self.text)
        return content[self.emitted :], calls


class ChatTemplate:
    """A checkpoint's chat template(s), compiled once: `render` turns messages (and tools) into the prompt."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str], origin: Path):
        try:
            self.templates = {name: _environment().from_string(source) for name, source in templates.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template is not valid Jinja ({e})") from None
        self.special_tokens = special_tokens
        self.tool_call_format = tool_call_format("".join(templates.values()))

    @classmethod
    def of_model(cls, model) -> "ChatTemplate | None":
        """The template of a loaded model: its checkpoint directory's, or a GGUF file's (tokenizer.chat_template,
        with the file's own bos and eos tokens)."""
        if model.path.is_dir():
            return cls.of_checkpoint(model.path)
        tokenizer, config = model.tokenizer, model.config
        if tokenizer is None or not tokenizer.chat_template:
            return None
        ids = {"bos_token": config.bos_token_id, "eos_token": next(iter(config.eos_token_ids), None)}
        special = {name: tokenizer.token_text(i) for name, i in ids.items() if i is not None}
        return cls({"default": tokenizer.chat_template}, special, model.path)

    @classmethod
    def of_checkpoint(cls, directory: Path) -> "ChatTemplate | None":
        """The template of chat_template.jinja or else of tokenizer_config.json's chat_template (one string, or
        named templates as transformers saves them); None when the checkpoint has none."""
        config = directory / "tokenizer_config.json"
        settings = read_json(config)
        special_tokens = {name: _token_text(settings[name]) for name in SPECIAL_TOKENS if settings.get(name)}
        if (directory / TEMPLATE_FILE).is_file():
            return cls({"default": (directory / TEMPLATE_FILE).read_text()}, special_tokens, directory / TEMPLATE_FILE)
        template = settings.get("chat_template")
        if isinstance(template, list):
            return cls({t["name"]: t["template"] for t in template}, special_tokens, config)
        return cls({"default": template}, special_tokens, config) if template else None

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt of a conversation, ending with the generation prompt of the assistant's turn. As in
        transformers, the template named "tool_use" renders requests with tools, where a checkpoint has one."""
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise ChatTemplateError(f"the checkpoint's chat templates have none named {name!r}")
        try:
            return self.templates[name].render(
                messages=messages, tools=tools, add_generation_prompt=True, **self.special_tokens
            )
        except jinja2.TemplateError as e:  # raise_exception from the template, or a template that does not work
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' template environment: the sandbox, blocks trimmed, loop controls, its helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: transformers uses the tag to find the
    assistant's tokens when training, which serving does not need, but templates that have it must compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: jinja2's own escapes HTML characters, which a prompt must not have.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _token_text(token) -> str:
    """A special token of tokenizer_config.json: its text, or an AddedToken's {"content": ...}."""
    return token["content"] if isinstance(token, dict) else token
