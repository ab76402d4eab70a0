"""Speculative decoding: proposers that guess a sequence's next tokens cheaply (ngram.py:
prompt lookup), their configuration (config.py), and the verifier that keeps the guesses
the target model agrees with, exactly as if it had drawn each token itself (verify.py).
The engine wiring (lookahead slots, k+1 positions per sequence) is not here yet."""
