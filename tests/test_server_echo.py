"""`echo` on `/v1/completions` through the official `openai` client: the prompt before
the generated text, its tokens' log-probabilities (null for the first) equal to
transformers' log_softmax within 1e-4 and followed by the generated ones, in OpenAI's
legacy shape; `max_tokens: 0` scores the prompt alone; streams carry the prompt in each
choice's first chunk; batches echo each prompt."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import load_hf
from live_server import NAME, LiveServer

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def oracle(chat_model_dir):
    """transformers' log_softmax [len, vocab] after each token of a prompt's ids."""
    hf = load_hf(chat_model_dir)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return log_softmax


def test_echo_scores_the_prompt_as_transformers(server: LiveServer, oracle) -> None:
    client = server.client()
    ids = server.engine.tokenizer.encode(PROMPT)
    out = client.completions.create(
        model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    choice = out.choices[0]
    lps = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lps.tokens) == len(ids) + 1
    token_str = [server.engine.tokenizer.decode([t]) for t in ids]
    assert lps.tokens[: len(ids)] == token_str
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    want = oracle(ids)
    for t in range(1, len(ids)):
        assert abs(lps.token_logprobs[t] - want[t - 1, ids[t]].item()) < TOL
        best = int(want[t - 1].argmax())
        ((token, value),) = lps.top_logprobs[t].items()
        assert token == server.engine.tokenizer.decode([best])
        assert abs(value - want[t - 1, best].item()) < TOL
    # The generated token: greedy, the most likely after the whole prompt.
    assert abs(lps.token_logprobs[-1] - want[-1].max().item()) < TOL
    offsets = [sum(len(s) for s in lps.tokens[:i]) for i in range(len(lps.tokens))]
    assert lps.text_offset == offsets
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1
    server.assert_pool_whole()


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server: LiveServer, oracle) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    batch = [ids, ids[:4]]
    out = server.client().completions.create(
        model=NAME, prompt=batch, echo=True, logprobs=2, max_tokens=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, batch, strict=True):
        assert choice.text == server.engine.tokenizer.decode(prompt)
        assert choice.finish_reason == "length"
        lps = choice.logprobs
        assert len(lps.tokens) == len(prompt) and lps.token_logprobs[0] is None
        want = oracle(prompt)
        got = [lps.token_logprobs[t] - want[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
        assert max(abs(d) for d in got) < TOL
        assert all(len(top) == 2 for top in lps.top_logprobs[1:])
    # Echo without logprobs: the text only.
    plain = server.client().completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    server.assert_pool_whole()


def test_streams_echo_the_prompt_first(server: LiveServer) -> None:
    client = server.client()
    args = dict(model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**args, n=2).choices
    chunks = list(client.completions.create(**args, n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].text.startswith(PROMPT)
        assert "".join(c.text for c in mine) == whole[index].text
        tokens = [t for c in mine for t in c.logprobs.tokens]
        assert tokens == whole[index].logprobs.tokens
        assert mine[0].logprobs.token_logprobs[0] is None
    server.assert_pool_whole()
