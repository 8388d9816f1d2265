"""The request bodies, and `parse_body`: 400 for a body that is not JSON, 422 naming the fields
that do not fit (the OpenAI chat request is read as OpenAI clients send it)."""

import json

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pipeline.serve.errors import ApiError, describe


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: StrictStr
    max_new_tokens: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores
    conversation_id: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    stream: StrictBool = False
    n: StrictInt | None = None


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body as `model`: 400 if it is not JSON, 422 naming the fields if it does not fit."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, describe(e.errors())) from None
