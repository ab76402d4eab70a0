"""The tokenizer endpoints, in vLLM's shapes, at the server's root (where vLLM serves them
and lm-evaluation-harness's remote tokenizer calls them), behind the API key:

* `POST /tokenize`: `prompt` (text) or `messages` (a chat, rendered by the chat template
  as /v1/chat/completions renders it, with `tools` and `add_generation_prompt`) ->
  `tokens`, `count`, `max_model_len`, and `token_strs` with `return_token_strs`.
  `add_special_tokens` defaults to true for a prompt and false for messages (the
  template writes them), as in vLLM.
* `POST /detokenize`: `tokens` -> `prompt`, the text (special tokens kept).
* `GET /tokenizer_info`: the special tokens (`eos_token`, `bos_token`, `pad_token`,
  `unk_token` and their ids), `chat_template`, `model_max_length` (the longest sequence
  this server takes), `vocab_size`, `tokenizer_class`, and `add_bos_token` /
  `add_eos_token` where the tokenizer has them. Unlike vLLM's, it lists only these: the
  tokenizer's other settings include file paths of the server's.

Tokenizing runs on the server's tokenizer thread (prompts.py), as the generation
endpoints' does; the errors are theirs (400 naming the field, 404 for an unknown model).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.prompts import check_token_ids
from pagedllm.entrypoints.server.auth import ApiKey
from pagedllm.entrypoints.server.body import RequestReader
from pagedllm.entrypoints.server.errors import APIError
from pagedllm.entrypoints.server.messages import ChatMessage, check_messages
from pagedllm.entrypoints.server.prompts import PromptEncoder
from pagedllm.entrypoints.server.protocol import refuse
from pagedllm.entrypoints.server.serving import request_fields
from pagedllm.entrypoints.server.tools import offered_tools, tool_use
from pagedllm.errors import InvalidParameterError

SPECIAL_TOKENS = ("eos_token", "bos_token", "pad_token", "unk_token")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: Any = None
    return_token_strs: bool = False
    # vLLM's, which this server does not take: refused rather than ignored
    continue_final_message: bool = False
    chat_template: Any = None
    chat_template_kwargs: Any = None

    def check(self) -> list[dict[str, Any]] | None:
        """InvalidParameterError naming what is wrong; the tools offered, if any."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameterError("prompt", "give either prompt (text) or messages")
        refuse(
            {
                "continue_final_message": self.continue_final_message,
                "chat_template": self.chat_template is not None,
                "chat_template_kwargs": bool(self.chat_template_kwargs),
            }
        )
        if self.messages is None:
            if self.tools is not None:
                raise InvalidParameterError("tools", "tools go with messages, not with a prompt")
            return None
        check_messages(self.messages)
        return offered_tools(tool_use(self.tools, None))

    async def token_ids(self, encoder: PromptEncoder) -> list[int]:
        """The token ids asked for (after `check`, which gives the tools)."""
        tools = self.check()
        if self.messages is None:
            assert self.prompt is not None
            special = True if self.add_special_tokens is None else self.add_special_tokens
            return await encoder.text(self.prompt, special)
        return await encoder.chat(
            [m.template_dict() for m in self.messages],
            self.add_generation_prompt,
            tools,
            add_special_tokens=bool(self.add_special_tokens),
        )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


def tokenizer_router(
    engine: EngineClient, encoder: PromptEncoder, reader: RequestReader, api_key: ApiKey
) -> APIRouter:
    """POST /tokenize, POST /detokenize, GET /tokenizer_info."""
    router = APIRouter(dependencies=[Depends(api_key)])
    # Read once, here: on the event loop later, a read could meet the tokenizer thread's
    # use of the tokenizer ("Already borrowed").
    tokenizer = engine.tokenizer
    info = None if tokenizer is None else tokenizer_info(tokenizer, engine.max_model_len)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await reader.read(request, TokenizeRequest)
        with request_fields({}):
            ids = await req.token_ids(encoder)
        strs = await encoder.token_strs(ids) if req.return_token_strs else None
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        return JSONResponse({**body, "token_strs": strs})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await reader.read(request, DetokenizeRequest)
        with request_fields({}):
            if info is None:
                raise InvalidParameterError("tokens", "this model has no tokenizer")
            if req.tokens:  # no tokens are the empty text
                check_token_ids(req.tokens, info["vocab_size"], "tokens")
        return JSONResponse({"prompt": await encoder.decode(req.tokens)})

    @router.get("/tokenizer_info")
    async def get_info() -> JSONResponse:
        if info is None:
            raise APIError(404, "this model has no tokenizer", code="not_found")
        return JSONResponse(info)

    return router


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """What a client needs to tokenize as this server does (see the module's docstring)."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
        info[f"{name}_id"] = getattr(tokenizer, f"{name}_id", None)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default")
    info["chat_template"] = template if isinstance(template, str) else None
    own_limit = getattr(tokenizer, "model_max_length", None)
    info["model_max_length"] = min(max_model_len, own_limit or max_model_len)
    info["vocab_size"] = len(tokenizer)
    for flag in ("add_bos_token", "add_eos_token"):
        value = getattr(tokenizer, flag, None)
        if isinstance(value, bool):
            info[flag] = value
    return info
