"""Structured output: grammars compiled for the model's tokenizer (grammar.py, kept by
the engine with each sequence's matcher; compiled first in worker processes killed at the
bound, compile_pool.py and compile_worker.py; kept in a cache bounded in bytes,
grammar_cache.py) and the token masks the sampler applies (bitmask.py). Those import
xgrammar (and so torch): the engine imports them only when a request asks for structured
output. unenforced.py (plain Python) knows which JSON-schema keywords the grammar would
not enforce."""
