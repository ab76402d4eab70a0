"""Content-Security-Policy for the HTML this project serves or writes.

The KV view is one self-contained file (its script and stylesheet inline, so that a
replay opens from disk), so a policy of 'self' alone would block it; instead `policy`
allows exactly the inline scripts and stylesheets the page holds, by their SHA-256
hashes, and nothing else unless named. A changed script gets a new hash by itself.
Inline `style="..."` attributes stay blocked: the pages set styles from script (CSSOM).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Sequence

# Inline elements only: an element with attributes (src=..., type="application/json")
# is not matched, and data blocks need no hash because they never run.
_INLINE = {kind: re.compile(rf"<{kind}>(.*?)</{kind}>", re.S) for kind in ("script", "style")}


def _sha256(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def policy(
    html: str,
    *,
    connect: Sequence[str] = (),
    scripts: Sequence[str] = (),
    styles: Sequence[str] = (),
    fonts: Sequence[str] = (),
    images: Sequence[str] = (),
    frame_ancestors: bool = True,
) -> str:
    """The policy for `html`: its inline scripts and styles by hash, plus the sources
    given. `frame_ancestors=False` for a <meta> policy, where browsers ignore it."""
    hashes = {kind: [_sha256(m) for m in rx.findall(html)] for kind, rx in _INLINE.items()}
    parts = [
        "default-src 'none'",
        "script-src " + " ".join([*hashes["script"], *scripts] or ["'none'"]),
        "style-src " + " ".join([*hashes["style"], *styles] or ["'none'"]),
        "img-src " + " ".join(images or ["'none'"]),
        "connect-src " + " ".join(connect or ["'none'"]),
        "base-uri 'none'",
        "form-action 'none'",
    ]
    if fonts:
        parts.append("font-src " + " ".join(fonts))
    if frame_ancestors:
        parts.append("frame-ancestors 'none'")
    return "; ".join(parts)
