"""LLM: the offline API, shaped like vLLM's so users can switch.

llm = LLM(block_size=16, kv_cache_memory="256MiB")
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(...))
outs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import LoadedModel
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptInput = str | dict[str, Any] | Sequence[int]
Message = dict[str, str]


class LLM:
    def __init__(
        self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_options: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), loaded)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | BeamSearchParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order (the
        params' output_kind is ignored: each output is the request's final one).
        `lora_request`: the LoRA adapter every prompt runs under, or one per prompt (None:
        the base model)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(
            sampling_params, (SamplingParams, BeamSearchParams)
        ):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidParameterError(
                    "sampling_params",
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts",
                )
        loras = _per_prompt(lora_request, len(prompts))
        # Only the final outputs are kept: the engine builds no other.
        final_only = {
            id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list
        }
        ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id, _prompt_of(prompt), final_only[id(params)], lora_request=lora
                )
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # nothing half-queued stays behind
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search in the engine; each output lists its beams best first."""
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)  # type: ignore[arg-type]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or several, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.encode_chat(conv, add_generation_prompt)}  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(self.engine.tokenizer, messages, add_generation_prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        generated = 0
        start = time.perf_counter()
        try:
            while len(done) < len(wanted) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        rate = generated / max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"{rate:.1f} generated tokens/s")
        finally:
            bar.close()
            for request_id in wanted - done.keys():  # interrupted: free their blocks
                engine.abort(request_id)
        return [done[r] for r in request_ids]


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise InvalidParameterError(
            "lora_request", f"got {len(loras)} LoRA requests for {num_prompts} prompts"
        )
    return loras


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise InvalidParameterError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return list(prompt)
