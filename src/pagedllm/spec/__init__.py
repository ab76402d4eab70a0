"""Speculative decoding: proposers that guess a sequence's next tokens cheaply (ngram.py:
prompt lookup) and their configuration (config.py). Plain Python. The verifier that keeps
the guesses the target model agrees with runs where the logits are, in the model runner
(worker/spec_verify.py); the engine decides who proposes (engine/speculation.py)."""
