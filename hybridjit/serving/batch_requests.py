"""The requests of an offline batch: JSON lines, each an id with a prompt (text or token ids, as /v1/completions
takes it) or chat messages (as /v1/chat/completions), and optionally the server's sampling fields (max_tokens,
temperature, top_p, top_k, seed, stop). They are the server's request bodies (protocol.py) plus an id, so a
line is checked exactly as the server checks a request.

Every line is checked before anything runs, and all bad lines are reported together, each with its line number
and field: a batch of hours must not fail at its 9,000th line. Checking is in two stages: the lines alone
(`read_requests`: JSON, fields, duplicate ids), then against the model (`encode_requests`: tokenizer, chat
template, vocabulary, context).
"""

import dataclasses
import hashlib
import json
from collections.abc import Iterable

from pydantic import ValidationError

from hybridjit.sampling import SamplingParams
from hybridjit.serving.chat import ChatTemplate, ChatTemplateError
from hybridjit.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    error_text,
    field_name,
    field_path,
)
from hybridjit.serving.throughput import Job
from hybridjit.tokenizer import no_tokenizer

# Bad lines listed in one error; more are counted.
MAX_LISTED = 20


class BatchInputError(ValueError):
    """Bad request lines: `problems` are (where, message) pairs, e.g. ("line 3", "temperature: ...")."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.problems = problems
        listed = [f"  {where}: {message}" for where, message in problems[:MAX_LISTED]]
        if len(problems) > MAX_LISTED:
            listed.append(f"  ... and {len(problems) - MAX_LISTED} more")
        lines = "line" if len(problems) == 1 else "lines"
        super().__init__(f"{source}: {len(problems)} bad {lines}, nothing was run:\n" + "\n".join(listed))


class PromptLine(CompletionRequest):
    id: str | int


class ChatLine(ChatCompletionRequest):
    id: str | int


# The batch's own fields: the server's would take stream and n, which a batch has no use for.
IGNORED = ("stream", "stream_options", "n", "model")


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    where: str  # "line 3" (of a file) or "request 3" (of a list): what errors call it
    body: PromptLine | ChatLine

    @property
    def id(self) -> str | int:
        return self.body.id


def id_key(request_id) -> str:
    """An id as a dictionary key: its JSON text, so that the id 1 and the id "1" stay distinct."""
    return json.dumps(request_id, ensure_ascii=False)


def check_defaults(defaults: dict) -> dict:
    """The batch-wide values of sampling fields (those a line leaves out), checked as a request's."""
    try:
        GenerationParams(**defaults)
    except ValidationError as e:
        error = e.errors()[0]
        raise ValueError(f"{field_name(field_path(error['loc']))} (the batch's default): {error_text(error)}") from None
    if "max_tokens" in defaults and defaults["max_tokens"] is None:
        raise ValueError("max_tokens: a batch needs a default number of tokens per request")
    return defaults


def read_requests(lines: Iterable[tuple[str, str | dict]], source: str, defaults: dict) -> list[BatchRequest]:
    """Requests from (where, JSON text or dict) pairs, `defaults` filling the fields a line leaves out. Raises
    BatchInputError listing every bad line (blank lines are skipped)."""
    requests, problems, first_seen = [], [], {}
    for where, raw in lines:
        if isinstance(raw, str):
            if not raw.strip():
                continue
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                problems.append((where, f"not valid JSON ({e})"))
                continue
        # Duplicates first, from the raw id: a line whose other fields are bad still claims its id.
        if isinstance(raw, dict) and isinstance(raw.get("id"), str | int):
            if (key := id_key(raw["id"])) in first_seen:
                problems.append((where, f"id: {raw['id']!r} repeats the id of {first_seen[key]}"))
                continue
            first_seen[key] = where
        try:
            requests.append(BatchRequest(where, _body(raw, defaults)))
        except ValueError as e:
            problems.append((where, str(e)))
    if problems:
        raise BatchInputError(source, problems)
    return requests


def _body(raw, defaults: dict) -> PromptLine | ChatLine:
    if not isinstance(raw, dict):
        raise ValueError(f"must be a JSON object, got {type(raw).__name__}")
    if ("prompt" in raw) == ("messages" in raw):
        raise ValueError("needs exactly one of prompt (text or token ids) and messages (a chat)")
    kind = ChatLine if "messages" in raw else PromptLine
    body = {**defaults, **{k: v for k, v in raw.items() if k not in IGNORED}}
    try:
        return kind(**body)
    except ValidationError as e:
        messages = [f"{field_name(field_path(error['loc']))}: {error_text(error)}" for error in e.errors()]
        raise ValueError("; ".join(messages)) from None


def derived_seed(request_id) -> int:
    """The seed of a request that gives none: a hash of its id, so that a resumed batch samples what an
    uninterrupted one would, and requests sharing a prompt still draw apart."""
    return int.from_bytes(hashlib.sha256(id_key(request_id).encode()).digest()[:8], "little")


def encode_requests(model, requests: list[BatchRequest], source: str) -> list[Job]:
    """The requests as runner Jobs (key: the BatchRequest), or BatchInputError listing every request the model
    cannot take (no tokenizer for text, no chat template, token ids outside the vocabulary, past the context)."""
    template = ChatTemplate.of_model(model) if any(isinstance(r.body, ChatLine) for r in requests) else None
    jobs, problems = [], []
    for request in requests:
        try:
            jobs.append(_job(model, template, request))
        except ValueError as e:
            problems.append((request.where, str(e)))
    if problems:
        raise BatchInputError(source, problems)
    return jobs


def _job(model, template: ChatTemplate | None, request: BatchRequest) -> Job:
    body, tokenizer, cfg = request.body, model.tokenizer, model.config
    if isinstance(body, ChatLine):
        if template is None:
            raise ValueError(f"messages: {model.path} has no chat template; send prompts instead")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        try:
            prompt = tokenizer.encode(template.render([m.for_template() for m in body.messages], tools))
        except ChatTemplateError as e:
            raise ValueError(f"messages: {e}") from None
        prompt_field, max_tokens, max_tokens_field = "messages", body.max_new_tokens, body.max_tokens_field
    else:
        if isinstance(body.prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt: {no_tokenizer(model.path)}: send token ids instead of text")
            prompt = tokenizer.encode(body.prompt)
        else:
            prompt = body.prompt
            if bad := [t for t in prompt if t >= cfg.vocab_size]:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        prompt_field, max_tokens, max_tokens_field = "prompt", body.max_tokens, "max_tokens"
    if not prompt:
        raise ValueError(f"{prompt_field}: is empty (no tokens)")
    if max_tokens is None:  # a chat line, in a batch without a default
        raise ValueError(f"{max_tokens_field}: is required")
    if body.stops and tokenizer is None:
        raise ValueError(f"stop: stop strings need a tokenizer; {no_tokenizer(model.path)}")
    if len(prompt) + max_tokens > (context := cfg.max_position_embeddings):
        raise ValueError(
            f"{max_tokens_field}: the prompt's {len(prompt)} tokens + {max_tokens_field} {max_tokens} exceed the "
            f"model's context of {context}"
        )
    seed = derived_seed(body.id) if body.seed is None else body.seed
    sampling = SamplingParams(body.temperature, body.top_k, body.top_p, seed)
    return Job(request, list(prompt), max_tokens, sampling, tuple(body.stops))
