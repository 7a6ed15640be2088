"""The OpenAI API's request bodies, as pydantic models: the server's validation is these declarations.

Strict: a number must be a JSON number and a string a string (no "5" for 5, no true for 1), as OpenAI's
API checks. Fields a client may send that change nothing here (user, metadata, ...) are ignored.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridjit.tokenizer import check_unicode

MAX_SEED = 2**64  # the seeds of SamplingParams' keys: non-negative integers below this
# pydantic's names for the members of a union, which it puts in an error's location after the field.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|dict|.*\[.*\])$")


def field_path(location: tuple) -> list:
    """The field a pydantic error's location names (its "loc" within the body), without pydantic's union members:
    ("messages", 0, "content", "str") -> ["messages", 0, "content"]."""
    return [part for part in location if not (isinstance(part, str) and _UNION_MEMBER.match(part))]


def field_name(path: list) -> str:
    """A field path as the error messages write it: messages[0].content."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)[1:]


def error_text(error: dict) -> str:
    """A pydantic error's message, without the "Value error, " it puts before our validators' messages."""
    return error["msg"].removeprefix("Value error, ")


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        """Every string in the body, at any depth: a lone surrogate (JSON's "\\ud800") would reach the tokenizer or
        the reply's UTF-8 and fail there."""
        _check_strings(value)
        return value

    @model_validator(mode="after")
    def _valid_unicode_extras(self):
        """The same for fields of a body's own that are kept (Message's, which templates may read)."""
        _check_strings(self.model_extra or {})
        return self


def _check_strings(value):
    if isinstance(value, str):
        check_unicode(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)


# Fields of OpenAI's API that change what is generated or returned and that this server does not implement: taken at
# their neutral values (what clients send by default), refused otherwise, never ignored. None is always neutral;
# a completion's logprobs=0 is not (OpenAI returns the chosen tokens' log probabilities).
UNSUPPORTED = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
    "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},),
}  # fmt: skip


class StreamOptions(Body):
    include_usage: bool = False


class GenerationParams(Body):
    """What completions and chat completions share."""

    model: str | None = None  # None: the served model
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # not OpenAI's (vLLM's): 0 keeps every token
    seed: Annotated[int, Field(ge=0, lt=MAX_SEED)] | None = None  # None: a fresh seed per request
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _neutral(cls, value, info):
        # True == 1 and False == 0: a bool is neutral only where the neutral value is that bool.
        if value is not None and not any(value == neutral and isinstance(value, bool) == isinstance(neutral, bool)
                                         for neutral in UNSUPPORTED[info.field_name]):
            raise ValueError(f"{value!r} is not supported by this server (only {UNSUPPORTED[info.field_name][0]!r})")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        if stop is not None and not all([stop] if isinstance(stop, str) else stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationParams):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
            raise ValueError("a list of prompts is not supported: send one prompt (a string or token ids) a request")
        return prompt


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCallMessage(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read fields of their own (reasoning...)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: a {self.role} message needs content (only an assistant's tool calls don't)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: content as one string (text parts joined, as vLLM does for
        templates that take strings), no fields left unset."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class Function(Body):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(Body):
    type: Literal["function"]
    function: Function


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] = "auto"  # "required" and named functions would need guided decoding

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
