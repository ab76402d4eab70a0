"""RunnerLoRA: the real runner's LoRA adapters, from files to each step's deltas.

It keeps an LRU host cache of loaded adapters (`max_cpu_loras`, keyed by path: the engine
binds one path to an adapter id for good), sizes adapters in pool pages, writes each
step's `lora_loads` into their pages, and builds the step's LoRABatch (lora/batch.py):
its adapters' stacks, read back from their pages (kept while the step's set of adapters
and pages stays the same, as decode steps do), and its token rows' tiles, from each
scheduled sequence's `lora_id`. Rows of the base (lora_id 0) cost nothing; a step with
none under an adapter gets no deltas at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.lora.adapter import LoRAAdapter, layer_elems, load_adapter
from pagedllm.lora.batch import AdapterStacks, LoRABatch, build_stacks, plan_rows
from pagedllm.lora.peft_config import TARGETS, LoRAConfig
from pagedllm.model.config import ModelConfig
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.lora_pages_io import page_floats, pages_for, read_adapter, write_adapter


class RunnerLoRA:
    def __init__(
        self,
        config: ModelConfig,
        max_lora_rank: int,
        max_cpu_loras: int,
        kv_itemsize: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.kv_itemsize = kv_itemsize
        self.device = device
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._paths: dict[int, str] = {}
        # The layout of every adapter written into pages, to read it back (kept past
        # drop_adapter: requests in flight finish under a removed adapter).
        self._layouts: dict[int, LoRAConfig] = {}
        self._stacks_key: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self._stacks: AdapterStacks | None = None
        self.num_disk_loads = 0

    def _page(self, block_size: int) -> int:
        cfg = self.config
        return page_floats(block_size, cfg.num_key_value_heads, cfg.head_dim, self.kv_itemsize)

    def adapter(self, path: str) -> LoRAAdapter:
        """The adapter at `path`, from the host cache or the disk (checked)."""
        adapter = self._host.get(path)
        if adapter is not None:
            self._host.move_to_end(path)
            return adapter
        adapter = load_adapter(path, self.config, self.max_lora_rank)
        self.num_disk_loads += 1
        self._host[path] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def adapter_pages(self, lora_path: str, block_size: int) -> int:
        c = self.adapter(lora_path).config
        return pages_for(layer_elems(self.config, c.r, c.targets), self._page(block_size))

    def max_adapter_pages(self, block_size: int) -> int:
        elems = layer_elems(self.config, self.max_lora_rank, TARGETS)
        return pages_for(elems, self._page(block_size))

    def drop_adapter(self, lora_id: int) -> None:
        """Forget the adapter's host copy; its pages still serve the steps that name it."""
        path = self._paths.pop(lora_id, None)
        if path is not None:
            self._host.pop(path, None)

    def step_deltas(
        self, step: SchedulerOutput, cache: PagedKVCache, query_lens: Sequence[int]
    ) -> LoRABatch | None:
        """Write the step's adapter loads into their pages; the deltas of its rows (None:
        every row runs on the base)."""
        # Every read (host cache or disk) before any write: a read that fails fails the
        # step with no page written, and the engine evicts the step's loads.
        loads = [(load, self.adapter(load.lora_path)) for load in step.lora_loads]
        for load, adapter in loads:
            write_adapter(cache, adapter.pack(), load.pages)
            self._paths[load.lora_id] = load.lora_path
            self._layouts[load.lora_id] = adapter.config
            self._stacks_key = ()  # pages may hold another adapter now
        seq_ids = [s.lora_id for s in step.seqs]
        ids = tuple(sorted({i for i in seq_ids if i > 0}))
        if not ids:
            return None
        key = tuple((i, tuple(step.lora_pages[i])) for i in ids)
        if key != self._stacks_key or self._stacks is None:
            adapters = []
            for i, pages in key:
                c = self._layouts.get(i)
                if c is None:
                    raise RuntimeError(f"adapter {i} runs before any step loaded it into pages")
                adapters.append(
                    (c, read_adapter(cache, pages, layer_elems(self.config, c.r, c.targets)))
                )
            self._stacks = build_stacks(self.config, adapters, ids)
            self._stacks_key = key
        lookup = torch.tensor((0, *ids))
        seq_slots = torch.searchsorted(lookup, torch.tensor(seq_ids)) - 1  # base: -1
        row_slots = torch.repeat_interleave(seq_slots, torch.tensor(list(query_lens)))
        tiles = plan_rows(row_slots.to(self.device), len(ids))
        return None if tiles is None else LoRABatch(self._stacks, tiles)
