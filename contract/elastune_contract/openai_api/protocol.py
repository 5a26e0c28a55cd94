"""The OpenAI wire format the worker speaks: request bodies (validated with readable errors) and the
response shapes published in the OpenAPI document.

Fields OpenAI clients send that this engine does not implement are accepted at their neutral values
and refused with a 400 naming the field otherwise (never silently ignored); vLLM's extensions that
routers and benchmarks use (``top_k``, ``ignore_eos``, ``stop_token_ids``, ``priority``) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 16

# Numeric bounds: every number a request carries is checked here, before the engine sees it (a value
# past what the engine's libraries take failed a whole batch of other requests once).
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""torch.Generator.manual_seed's inclusive range (negative seeds are mapped onto the unsigned range)."""
MAX_N = 128
"""Completions per request OpenAI's API accepts at most (n, best_of)."""
MAX_LOGPROBS = 20
"""OpenAI's bound on logprobs / top_logprobs."""
MAX_LOGIT_BIAS_ENTRIES = 1024
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def invalid_unicode(value: object, path: str = "") -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode text, or None. JSON can carry
    a lone surrogate (``"\\ud800"``) that Python decodes into a str no UTF-8 encoder or tokenizer takes
    (it reached the worker's tokenizer and answered 500 TypeError)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        items: Any = ((k, getattr(value, k)) for k in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = invalid_unicode(key, path) if isinstance(key, str) else None
        where = where or invalid_unicode(item, f"{path}.{key}" if path else str(key))
        if where:
            return where
    return None


class _Request(BaseModel):
    # Unknown fields are ignored as OpenAI's API and vLLM do: clients add their own (user, metadata).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="after")
    def _valid_unicode(self) -> _Request:
        where = invalid_unicode(self)
        if where:
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate such as \\ud800)")
        return self

    model: str = Field(min_length=1, description="A model id from /v1/models.")
    max_tokens: TokenCount | None = Field(
        default=None, description="Tokens to generate at most; default: the rest of the context."
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = Field(
        default=-1, description="vLLM extension; -1 or 0: off."
    )
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
        default=None, description="Same seed and prompt, same tokens; within [-2**63, 2**64 - 1]."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(
        default=False, description="vLLM extension: generate max_tokens whatever EOS says."
    )
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = Field(
        default=0, description="vLLM extension: lower values are served first."
    )
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    logprobs: bool | int | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | int | None) -> bool | int | None:
        if not isinstance(v, bool) and isinstance(v, int) and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be true, false or an integer in [0, {MAX_LOGPROBS}]")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key in v:
            if not key.isascii() or not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"keys are token ids (integers in [0, {INT32_MAX}]), got {key[:32]!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first option set to a value this engine does not implement."""
        if self.n != 1:
            return "n", "only n=1 is supported; send one request per completion"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not supported"
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids; a list of one prompt is accepted (batches: one request each)."
    )
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        batch = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list)
        if batch and len(self.prompt) != 1:
            return "prompt", "one prompt per request; send a batch as separate requests"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # a list of one prompt (checked in unsupported)
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "structured output is not supported"
        return super().unsupported()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's runtime LoRA API)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=253, description="The name requests use as `model`.")
    lora_path: str = Field(
        min_length=1, description="A PEFT save_pretrained directory: a path, file:// or pvc://claim/path."
    )


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)


# -- responses (documented in the OpenAPI document; built as plain dicts on the hot path) ------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "elastune"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


_Request.model_rebuild()
ChatMessage.model_rebuild()
