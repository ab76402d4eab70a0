"""The OpenAI wire format of responses: logprobs of completions and chat, model cards.

Choices and chunks are plain dicts built in serving.py; these are the nested objects whose
shape is worth a model.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    # vLLM's: the model's path (an adapter's folder) and, for an adapter, its base's id
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
