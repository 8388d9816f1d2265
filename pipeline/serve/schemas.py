"""The request bodies, and `parse_body`: the body read under its limits (`body`: 415, 413, 400),
then 422 naming the fields that do not fit (the OpenAI chat request is read as OpenAI clients
send it). The ranges of the sampling fields are checked by `AnswerLimits`, as `jobs.answer` and
the `Answerer` check them."""

from typing import Literal

from fastapi import Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from pipeline.serve.body import check_media_type, load_json, read_body
from pipeline.serve.errors import ApiError, describe


class LiveMessage(BaseModel):
    """A message of the answer body's live tail (the chat route reads its earlier messages)."""
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: StrictStr
    max_new_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # a number: not "0.5", not true
    # the session the client is in, which no cache holds: read after the top-up, before the
    # question (pipeline.kv.prompts.live_text)
    live: list[LiveMessage] | None = None


class ContentPart(BaseModel):
    """A part of a message's content: text only (the model reads text), so an image or audio
    part is refused naming it rather than dropped unread."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` asks for a last chunk holding the usage."""
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores
    conversation_id: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # a number: not "0.5", not true
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk holding the usage (`stream_options`)."""
        return self.stream_options is not None and self.stream_options.include_usage


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    """The JSON body as `model`: 415 if it is not declared JSON, 413 if it is over `max_bytes`,
    400 if it is not JSON or nests too deeply, 422 naming the fields if it does not fit."""
    check_media_type(request.headers.get("content-type"))
    data = load_json(await read_body(request, max_bytes))
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, describe(e.errors())) from None
