"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are strict: unknown fields are refused (a misspelt `temprature` silently ignored is a worse bug than a
400), JSON booleans are not numbers, numbers are finite, integers are integers. They are validated from the raw
body with `model_validate_json`, so NaN/Infinity literals are refused by the same rules as any other bad value.
Fields that take several shapes (`prompt`, `stop`, message `content`, `tool_choice`) are checked by hand so the error
names the field and the accepted shapes instead of listing one failure per union branch.

Sampling fields left out (None) take the checkpoint's generation_config.json defaults (see serving.py).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The sampler's limits (qwen_jax.sampling.RequestSampling), checked here so the 400 names the request field.
SEED_LIMIT = 2 ** 64
INT32_MAX = 2 ** 31 - 1
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# A reply's most choices (`n`); the engine's wait queue (--max-queued) may hold fewer, which the server checks.
MAX_CHOICES = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _finite_json(value: Any, where: str) -> Any:
    """Free-form JSON (chat_template_kwargs) still refuses NaN/Infinity, like every other field."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds a non-finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_json(v, where)
    elif isinstance(value, list):
        for v in value:
            _finite_json(v, where)
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(s == "" for s in items):
        raise ValueError("stop strings must not be empty")
    return tuple(dict.fromkeys(items))


Temperature = Annotated[float, Field(ge=0.0, le=1e4)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
# -1 is vLLM's spelling of "off"; 0 is the engine's.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `schema` is compiled by qwen_jax.structured (keywords it cannot
    enforce are a 400); `strict` is accepted either way: the schema is always enforced."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _finite_schema(cls, value):
        return _finite_json(value, "schema")


class ResponseFormat(_Strict):
    """OpenAI's response_format: "text" (free), "json_object" (a JSON object) or "json_schema" (JSON that follows
    the given schema), enforced token by token (qwen_jax.structured)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only allowed with it')
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (extra_body), exactly one of: `json` (a JSON schema, or its text), `json_object`
    (true: a JSON object), `choice` (the reply is one of these strings, as written), `regex` (the whole reply
    matches it: `qwen_jax.regex`'s syntax), `grammar` (GBNF: the reply is a text its `root` rule produces,
    `qwen_jax.ebnf`'s syntax). vLLM's `structural_tag` is refused."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    regex: str | None = None
    grammar: str | None = None
    structural_tag: Any = None

    @model_validator(mode="after")
    def _check_one(self):
        if self.structural_tag is not None:
            raise ValueError("structural_tag is not supported by this server (json, json_object, choice, regex and "
                             "grammar are)")
        if isinstance(self.json_, str):
            try:
                self.json_ = json.loads(self.json_)
            except ValueError as e:
                raise ValueError(f"json: not a JSON schema's text ({e})") from None
            if not isinstance(self.json_, dict):
                raise ValueError("json: the schema must be a JSON object")
        _finite_json(self.json_, "json")
        given = [n for n, v in (("json", self.json_), ("json_object", self.json_object or None),
                                ("choice", self.choice), ("regex", self.regex), ("grammar", self.grammar))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object (true), choice, regex and grammar, got "
                             f"{given or 'none'}")
        return self


class _SamplingFields(_Strict):
    """Fields shared by chat and completions requests."""
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Any = Field(default=None, validate_default=True)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's min_tokens: no stop id (EOS, stop_token_ids) among the first min_tokens tokens, and stop strings looked
    # for only after them; at most max_tokens.
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    # Choices of one reply: each its own stream in the engine (seeds: qwen_jax.sampling.choice_seed).
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    # Not an OpenAI field: False asks for serial decoding (the exact reference that drafting must equal).
    draft: bool = True
    # Penalties on tokens already in the context (qwen_jax.sampling.Penalties).
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None  # None: the checkpoint's default
    # OpenAI's logit_bias: token id (as a JSON key) -> bias in [-100, 100], added to the logits before penalties.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Structured outputs: the reply follows a JSON schema, or is a JSON object (enforced while sampling).
    response_format: ResponseFormat | None = None
    # vLLM's spelling of the same (and `choice`); not both.
    structured_outputs: StructuredOutputs | None = None
    # vLLM's return_token_ids: the reply's token ids on each choice (`token_ids`, stream chunks too) and the prompt's
    # (`prompt_token_ids`: chat on the response, completions on each choice).
    return_token_ids: bool = False
    # vLLM's older spelling of structured_outputs (guided decoding): at most one, read as structured_outputs.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: this server has one
    user: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, value: Any) -> tuple[str, ...]:
        return _stop_strings(value)

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "stream_options is only allowed when stream is true")
        guided = [(name, value) for name, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None]
        if guided:
            name, value = guided[0]
            field = f"guided_{name}"
            if len(guided) > 1:
                raise _FieldError(f"guided_{guided[1][0]}", f"{field} and guided_{guided[1][0]}: send one")
            if self.structured_outputs is not None:
                raise _FieldError(field, f"{field} and structured_outputs: send one")
            try:
                self.structured_outputs = StructuredOutputs.model_validate({name: value})
            except ValidationError as e:
                raise _FieldError(field, e.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")) \
                    from None
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            param = self.structured_param
            raise _FieldError(param, f"{param} and a JSON response_format: send one")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise _FieldError("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got "
                                                f"{key!r}")
        return self

    @property
    def structured_param(self) -> str:
        """The field that asked for structured outputs: structured_outputs or a guided_* one."""
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())


class _FieldError(ValueError):
    """A cross-field check that should name one field as the error's `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


# ---------------------------------------------------------------------------------------------------- chat

class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    # Earlier assistant turns may carry their reasoning; the chat template places it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, value: Any) -> str | list[dict[str, str]] | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of content parts, or null")
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"part {i} must be an object with a string `type`")
            if part["type"] == "image_url":
                parts.append(dict(part))  # checked and decoded by server/images.py (a 400 naming the part)
                continue
            if part["type"] in ("image", "input_image", "video", "video_url", "input_audio"):
                raise ValueError(f"part {i}: {part['type']} input is not supported by this server (images go in "
                                 "image_url parts)")
            parts.append(TextPart.model_validate(part).model_dump())
        return parts


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, rendered into the prompt as given
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _finite_parameters(cls, value):
        return _finite_json(value, "parameters")


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    """tool_choice naming one function: the reply is one call of it."""
    type: Literal["function"]
    function: FunctionName


def _tool_choice(value: Any) -> Literal["auto", "none", "required"] | NamedToolChoice | None:
    """"auto" and "none" leave the model free; "required" (at least one call of the tools) and a named function (one
    call of it) force calls: the reply is a JSON document of the calls, enforced by a grammar (serving.py)."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            raise ValueError('a named function must be {"type": "function", "function": {"name": NAME}}') from None
    raise ValueError('must be "auto", "none", "required" or {"type": "function", "function": {"name": NAME}}')


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)
    tool_choice: Any = None  # None: "auto" with tools
    # False: at most one call under tool_choice "required" (the grammar's array holds one item); otherwise how many
    # calls a reply makes is the model's choice.
    parallel_tool_calls: bool | None = None
    # Qwen's thinking_budget: where the prompt leaves a think block open (thinking on), the reply's first
    # thinking_budget tokens may think; if the block is still open then, its next token closes it (</think>).
    # Ignored with thinking off.
    thinking_budget: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _finite_kwargs(cls, value):
        return _finite_json(value, "chat_template_kwargs")

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> str | NamedToolChoice | None:
        return _tool_choice(value)

    @property
    def parse_tools(self) -> bool:
        """Tools go to the chat template and calls come out of the reply (parsed, or forced by tool_choice)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_calls(self) -> bool:
        """tool_choice "required" or a named function: the reply is a document of calls (serving.py)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def forced_function(self) -> str | None:
        """The function tool_choice names, or None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise _FieldError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one")
        if self.forces_calls:
            what = '"required"' if self.forced_function is None else f"function {self.forced_function!r}"
            if not self.tools:
                raise _FieldError("tool_choice", f"tool_choice {what} needs tools to call; none were given")
            names = [t.function.name for t in self.tools]
            if self.forced_function is not None and self.forced_function not in names:
                raise _FieldError("tool_choice", f"tool_choice names function {self.forced_function!r}, which is "
                                                 f"not among tools ({', '.join(names)})")
            if self.response_format is not None and self.response_format.type != "text":
                raise _FieldError("response_format", f"response_format {self.response_format.type} cannot be "
                                                     f"combined with tool_choice {what}: the reply is the call's "
                                                     "JSON, whose format the tools' parameters set")
            if self.structured_outputs is not None:
                raise _FieldError("structured_outputs", f"structured_outputs cannot be combined with tool_choice "
                                                        f"{what}: the reply is the call's JSON")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ------------------------------------------------------------------------------------------------ completions

class CompletionRequest(_SamplingFields):
    prompt: Any
    # OpenAI's completions default (and vLLM's): 16 new tokens when max_tokens is absent.
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    add_special_tokens: bool = True

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str | list[int]]:
        return _prompt_batch(value)

    @model_validator(mode="after")
    def _check_completion(self):
        if self.echo:
            raise _FieldError("echo", "echo is not supported by this server")
        return self


def _prompt_batch(value: Any) -> list[str | list[int]]:
    """OpenAI's prompt: a string, a list of token ids, or a batch (a list) of either -> the batch's prompts (at most
    MAX_CHOICES; a reply's choices are prompt i's choice j at index i * n + j)."""
    if isinstance(value, str) or (isinstance(value, list) and not any(isinstance(x, (str, list)) for x in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} prompts a request, got {len(value)}")
    out = []
    for i, p in enumerate(value):
        where = f"prompt {i}: " if len(value) > 1 else ""
        if isinstance(p, str):
            out.append(p)
            continue
        if not isinstance(p, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            raise ValueError(f"{where}must be a string or a list of token ids")
        if not p:
            raise ValueError(f"{where}the prompt is empty")
        if any(not 0 <= x <= INT32_MAX for x in p):
            raise ValueError(f"{where}token ids must be non-negative integers")
        out.append(p)
    return out


# ------------------------------------------------------------------------------------------- tokenize routes

class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)  # rendered as the chat route does
    return_token_strs: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _finite_kwargs(cls, value):
        return _finite_json(value, "chat_template_kwargs")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class DetokenizeResponse(BaseModel):
    prompt: str


# ----------------------------------------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens resumed from the prompt cache (not run again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the reply was all reasoning or tool calls
    # The think block with --reasoning-parser; under both names, since vLLM renamed `reasoning_content` to
    # `reasoning` and then dropped the old one, and clients read one or the other.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


def _absent_if_none(value) -> bool:
    return value is None


# Fields sent only when asked for (return_token_ids) or when they say something, absent otherwise rather than null.
TokenIds = Annotated[list[int] | None, Field(default=None, exclude_if=_absent_if_none)]
# vLLM's stop_reason: the stop string that ended the reply, or the stop_token_ids id (absent: EOS, length, ...).
StopReason = Annotated[str | int | None, Field(default=None, exclude_if=_absent_if_none)]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: StopReason = None
    token_ids: TokenIds = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: TokenIds = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: StopReason = None
    prompt_token_ids: TokenIds = None
    token_ids: TokenIds = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qwen-jax"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
