"""OpenAI's request bodies as typed models (as vLLM's `protocol.py`): what each field may hold,
its default, and what this server does with it. The entry validates every `/v1` body with them,
and `docs/openapi.yml`'s `/v1` section is generated from them (`make docs`).

Tolerant where OpenAI's own clients and common frameworks need it: fields a model does not list
are kept aside (`ignored`, logged by the entry, as vLLM does) rather than refused; parameters this
server does not implement are accepted at any falsy value (None, False, 0, "", [], {}) and at
their harmless values, and refused otherwise, naming themselves."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

# At most this many choices a request may ask for (`n`).
MAX_N = 8
MAX_TOP_LOGPROBS = 20
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @property
    def ignored(self) -> list[str]:
        """Fields this server does not know: ignored, for the log to name."""
        return sorted(self.model_extra or {})


def _only_falsy(value: Any, info) -> Any:
    if value:
        raise ValueError(f"'{info.field_name}' is not supported here (only a neutral value: null, 0, false)")
    return value


class StreamOptions(OpenAIBody):
    include_usage: StrictBool | None = False


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIBody):
    """One turn; `developer` is OpenAI's new name for `system` (the chat template gets `system`).
    An empty or null content is a turn all the same (an empty system prompt, an assistant turn
    that only called a tool)."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class _Generation(OpenAIBody):
    """What completions and chat completions share."""
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1, description="at most the model's context less the prompt")
    temperature: Temperature | None = Field(None, description="default 1; 0 is greedy")
    top_p: TopP | None = None
    # At most a signed 64-bit integer, as vLLM's: the seed travels in every step's JSON header.
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1, description="the same seed samples the same tokens")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="up to 4 non-empty strings")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(1, ge=1, le=MAX_N, description="choices, each its own sequence")
    user: StrictStr | None = None
    ignore_eos: StrictBool | None = Field(False, description="vLLM's extension: generate past the end of text")
    # Not implemented: accepted at a neutral value only.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    tools: list[Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')

    _neutral = field_validator("frequency_penalty", "presence_penalty", "logit_bias", "tools",
                               "parallel_tool_calls")(_only_falsy)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("'stop' takes a non-empty string or a list of at most 4 of them")
        return stops

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value and value != {"type": "text"}:
            raise ValueError("only {\"type\": \"text\"} is supported")
        return value


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: StrictBool | None = Field(False, description="each token's log-probability")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="with logprobs: that many likeliest tokens at each position")


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictStr] = Field(description="a string, or a list of exactly one")
    logprobs: StrictInt | None = Field(None, ge=0, le=5, description="the likeliest tokens' log-probabilities")
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    _neutral_too = field_validator("echo", "suffix")(_only_falsy)

    @field_validator("best_of")
    @classmethod
    def _one(cls, value):
        if value not in (None, 0, 1):
            raise ValueError("'best_of' is not supported (only 1)")
        return value

    @field_validator("prompt")
    @classmethod
    def _single(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("'prompt' must be a string or a list of exactly one")
            value = value[0]
        if not value.strip():
            raise ValueError("'prompt' is empty")
        return value


class EmbeddingRequest(OpenAIBody):
    model: StrictStr
    input: StrictStr | list[StrictStr] = Field(description="a text or a list of texts (token arrays are not taken)")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="OpenAI's client asks for base64 (little-endian float32) unless told otherwise")
    dimensions: StrictInt | None = None
    user: StrictStr | None = None

    _neutral = field_validator("dimensions")(_only_falsy)


REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
            "/v1/embeddings": EmbeddingRequest}
