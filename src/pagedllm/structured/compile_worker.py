"""A grammar compiler's worker process: (kind, text) in, whether it compiles out.

xgrammar cannot interrupt a compile, and some grammars take minutes, so a grammar is
compiled first in a worker process that compile_pool.py kills at the bound. A worker
builds the library's compiler for the model's tokenizer once, then answers one job at a
time over its pipe: ("ok", "") or ("error", why, for the client). Before it compiles, it
checks that the grammar has a finite sentence: one whose every derivation goes on
forever could never end an output, and would leave a sequence with no token to draw.
`compile_grammar` is the compile itself, the worker's and then the server's.
"""

from __future__ import annotations

import json
import os
import re
import signal
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

READY = "ready"
# The library's messages open with "[time] /path/file.cc:line: ": the client needs the rest.
_LOCATION = re.compile(r"^\s*\[[0-9:.]+\]\s*\S+:\d+:\s*")
# xgrammar's expression kinds (GrammarExprType in its grammar_impl.h) that refer to others,
# in the layout of its serialization version below: each expression is [kind, length,
# *items]. The rest (text, character classes, the empty string, tag dispatch) end.
_LAYOUT = "v18"
RULE_REF, SEQUENCE, CHOICES, REPEAT = 4, 5, 6, 8  # REPEAT's items: rule, least, most


class NoFiniteSentenceError(ValueError):
    def __init__(self) -> None:
        super().__init__(
            "it has no finite sentence: every way through its rules goes on forever, so no "
            "output could ever end"
        )


def main(conn: Connection, tokenizer_info: str) -> None:
    """The worker's loop, until the server closes the pipe (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(
        info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
    )
    conn.send(READY)
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            grammar = to_grammar(kind, text)
            if not has_finite_sentence(grammar):
                raise NoFiniteSentenceError()
            compiler.compile_grammar(grammar)
            reply = ("ok", "")
        except Exception as exc:  # the library raises RuntimeError, and others
            reply = ("error", clean(exc))
        conn.send(reply)


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """The compiled grammar of StructuredOutputs' key (kind, text), by `compiler` (an
    xgrammar GrammarCompiler)."""
    return compiler.compile_grammar(to_grammar(kind, text))


def to_grammar(kind: str, text: str) -> Any:
    if kind == "json":
        # Compact JSON (no free whitespace): a weak model cannot pad the output with
        # spaces until max_tokens, and the output is as short as the schema allows.
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))
        return xgr.Grammar.from_ebnf(f"root ::= {rule}")
    return xgr.Grammar.from_ebnf(text)


def has_finite_sentence(grammar: Any) -> bool:
    """Whether the root rule derives some finite text: the rules that can end, found by
    the usual fixpoint (a sequence ends when all its parts can, a choice when one can, a
    rule when its body can), in time linear in the grammar. A layout or expression kind
    this code does not know counts as able to end: never refused for what it cannot
    read."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _LAYOUT:
        return True
    flat = data["grammar_expr_data"]
    bounds = [*data["grammar_expr_indptr"], len(flat)]  # where each expression starts
    exprs = [flat[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    rule_of_body: dict[int, list[int]] = {}
    for r, rule in enumerate(data["rules"]):
        rule_of_body.setdefault(rule[1], []).append(r)
    parents: list[list[int]] = [[] for _ in exprs]  # expression -> those that contain it
    users: list[list[int]] = [[] for _ in data["rules"]]  # rule -> expressions that use it
    waiting = [0] * len(exprs)  # a sequence's parts that cannot end yet
    ends_now: list[int] = []
    for e, (kind, _, *items) in enumerate(exprs):
        if kind == RULE_REF or (kind == REPEAT and items[1] > 0):
            users[items[0]].append(e)
        elif kind in (SEQUENCE, CHOICES):
            for item in items:
                parents[item].append(e)
            if kind == SEQUENCE:
                waiting[e] = len(items)
                if not items:
                    ends_now.append(e)
        else:  # text, the empty string, a repeat that may be empty, or a kind not known here
            ends_now.append(e)
    can_end = [False] * len(exprs)
    rule_ends = [False] * len(data["rules"])
    while ends_now:
        e = ends_now.pop()
        if can_end[e]:
            continue
        can_end[e] = True
        for parent in parents[e]:
            if exprs[parent][0] == SEQUENCE:
                waiting[parent] -= 1
                if waiting[parent]:
                    continue
            ends_now.append(parent)
        for r in rule_of_body.get(e, ()):
            if not rule_ends[r]:
                rule_ends[r] = True
                ends_now += users[r]
    return rule_ends[data["root_rule_id"]]


def clean(exc: BaseException) -> str:
    """The library's message without its source location, on one line."""
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    text = " ".join(line for line in lines if line)
    return text[:300] or type(exc).__name__
