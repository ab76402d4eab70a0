"""Chat conversations -> prompt token ids under the model's chat template (`encode_chat`,
for the server and the offline API alike), with tools and tool-call history.

A chat template that reads `tools` (Qwen2/3, Hermes, Llama 3.1, ...) is given the tools and
renders them itself; one that reads `tool_calls` renders assistant calls and `tool` results
itself. A template that does not (SmolLM2-135M-Instruct's GGUF template is plain ChatML and
reads neither) gets them written in the Hermes format that Qwen's own template uses: the
tools as a system message block (`<tools>...</tools>` and the `<tool_call>` instructions),
each assistant call as `<tool_call>{"name", "arguments"}</tool_call>` in its content, and
each run of tool results as one user turn of `<tool_response>` blocks.

Whether a template reads a variable is decided from its source text (the name as a
word): a template that mentions `tools` only to ignore it would lose them, which no known
template does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.engine.prompts import check_text
from pagedllm.entrypoints.server.tool_parsers import CALL_END, CALL_START
from pagedllm.errors import InvalidParameterError

# The instructions the Hermes format opens with; the call tags are the ones the hermes
# tool-call parser reads back.
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    f"{CALL_START}{CALL_END} XML tags:\n{CALL_START}\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n' + CALL_END
)


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    param: str = "messages",
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) under the
    model's chat template, with the `tools` offered (OpenAI's function tools), if any:
    in the template's own way, or in the Hermes format where it has none.
    `add_special_tokens`: the tokenizer's own (a BOS) on top of the template's text."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError(
            param,
            "this model has no chat template (a base model, not an instruction-tuned one), so "
            "it cannot take chat messages; send the text as a plain prompt instead",
        )
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"{param}[{i}].content")
    rendered, template_tools = render_for_template(tokenizer, messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=template_tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as exc:  # the template is user-visible Jinja: any error is the input's
        raise InvalidParameterError(param, f"cannot apply the chat template: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def template_reads(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's chat template reads the variable or field `name`."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default", "")
    return bool(template) and re.search(rf"\b{re.escape(name)}\b", template) is not None


def hermes_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    return HERMES_TOOLS_PROMPT.format(
        tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    )


def hermes_call(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": fn["arguments"]}
    return f"{CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_END}"


def render_for_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to `apply_chat_template`: unchanged where the template
    reads them, written into the messages in the Hermes format where it does not."""
    out = [dict(m) for m in messages]
    if not template_reads(tokenizer, "tool_calls"):
        out = _hermes_history(out)
    if not tools:
        return out, None
    if template_reads(tokenizer, "tools"):
        return out, [dict(t) for t in tools]
    block = hermes_tools_block(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _hermes_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls as `<tool_call>` text; consecutive tool results as one user turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""] + [hermes_call(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out
