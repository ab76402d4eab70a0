"""The KV view's HTML: the live page (/kv) and self-contained replay files.

Both are the same template with the same stylesheet and script inlined (no build step,
no network: a replay file opens from disk anywhere), and the same table of KV event
fields (kv/events.py) for the script; only the mode and, for a replay, the trace differ.
Each page carries its Content-Security-Policy in a <meta> element (`content_policy`):
only its own inline script and stylesheet may run, by hash; the live server sends the
same policy as a header too, with `frame-ancestors`.
"""

from __future__ import annotations

import html
import json
import re
from functools import cache
from importlib import resources
from typing import Any

from pagedllm.entrypoints.server.csp import policy
from pagedllm.kv.events import EVENT_FIELDS

MODES = ("live", "replay")
# The fields of each kind of KV event, as the page's script checks them.
_EVENT_NAMES = {kind: list(fields) for kind, fields in EVENT_FIELDS.items()}


@cache
def _asset(name: str) -> str:
    return (
        resources.files("pagedllm.entrypoints.kv_view")
        .joinpath("static", name)
        .read_text(encoding="utf-8")
    )


def _script_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: no `</script>` or `<!--` can close it."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


@cache
def content_policy(mode: str, header: bool = False) -> str:
    """The page's policy; `header`: the HTTP header's form (with frame-ancestors, which a
    <meta> policy cannot carry). Only the live page talks to its server."""
    # The inline script and stylesheet are the assets alone, whatever the trace or title.
    code = {"/*__CSS__*/": _asset("kv_view.css"), "/*__JS__*/": _asset("kv_view.js")}
    page = _fill(_asset("kv_view.html"), code)
    connect = ("'self'",) if mode == "live" else ()
    return policy(page, connect=connect, frame_ancestors=header)


def render(mode: str, trace: dict[str, Any] | None = None, title: str = "pagedllm KV view") -> str:
    """The page: `mode` "live" (reads /kv/events) or "replay" (of `trace`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'live' or 'replay', got {mode!r}")
    if (trace is None) == (mode == "replay"):
        raise ValueError("a replay page needs a trace, and only a replay page takes one")
    parts = {
        "/*__CSS__*/": _asset("kv_view.css"),
        "/*__JS__*/": _asset("kv_view.js"),
        "__CONFIG__": _script_json({"mode": mode, "events": _EVENT_NAMES}),
        "__TRACE__": _script_json(trace),
        "__TITLE__": html.escape(title),
        "__MODE__": mode,
        # Only quotes need escaping in the attribute: the policy holds no '"', '&' or '<'.
        "__CSP__": content_policy(mode).replace('"', "&quot;"),
    }
    return _fill(_asset("kv_view.html"), parts)


def _fill(template: str, parts: dict[str, str]) -> str:
    # One pass: what is put in (a trace, the script) is never searched for markers again.
    pattern = "|".join(re.escape(marker) for marker in parts)
    return re.sub(pattern, lambda m: parts[m.group(0)], template)
