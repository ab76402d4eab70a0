"""Structured output: grammars compiled for the model's tokenizer (grammar.py, kept by
the engine with each sequence's matcher) and the token masks the sampler applies
(bitmask.py). Everything here imports xgrammar (and so torch): the engine imports it only
when a request asks for structured output."""
