"""Scheduler: continuous (iteration-level) batching over the paged block pool.

Every step gives each scheduled request some tokens to compute under two budgets
(`max_num_seqs`, `max_num_batched_tokens`): decodes first, then the rest of partly
computed prompts, then new requests from the waiting queue. A long prompt is split into
chunks; decode and prefill share a step. A decoding request with proposed tokens
(speculative decoding, `Request.draft_token_ids`) computes its last token and the k
proposals in one chunk of k+1 lookahead slots, counted in the token budget; after the
step only the accepted ones count as computed and the others' slots are given back
(`update_from_output`), as are the slots a step reaching a request's last token claims
past it for a draft model's next proposals (`Request.num_lookahead_tokens`). When a
running request cannot get a block, the most recently admitted running request is
preempted by recomputation: its blocks are freed and it goes back to the front of the
waiting queue keeping its generated tokens.

A request under a LoRA adapter (`Request.lora_id` > 0) pins it while it runs: admission
counts the adapter's pages when it is not resident and loads it (kv/adapter_pages.py),
finishing, aborting or preempting the request unpins it; the step lists the adapters it
loaded (`lora_loads`, for the runner to write) and the pages of every adapter it runs.

The output (core/scheduler_output.py) speaks to a runner that keeps its own copy of the
running sequences' block tables: a running sequence sends only what its tables gained.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.core.scheduler_output import AdapterLoad, ScheduledSeq, SchedulerOutput, SentTables
from pagedllm.core.sequence import Request, RequestStatus, Sequence
from pagedllm.errors import CONTEXT_LENGTH_EXCEEDED, KV_CACHE_EXCEEDED, InvalidParameterError
from pagedllm.kv.manager import KVCacheManager
from pagedllm.validation import check_int


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            check_int(getattr(self, name), name, min=1)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._running_seq_slots = 0
        self._seq_ids = itertools.count()
        self._finished_seq_ids: list[int] = []
        self._preempted_seq_ids: list[int] = []
        self._sent_tables = SentTables()  # what the runner's copy of the tables holds
        # Request id -> lookahead slots the last schedule() claimed past its chunk.
        self._lookahead: dict[str, int] = {}
        # Adapters loaded for requests admitted since the last step that ran.
        self._loads: dict[int, AdapterLoad] = {}
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # --------------------------------------------------------------- requests
    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def new_seq(
        self, token_ids: list[int], index: int = 0, num_prompt_tokens: int | None = None
    ) -> Sequence:
        """A new sequence over a copy of `token_ids` (all of them prompt unless
        `num_prompt_tokens` says otherwise), with the next sequence id."""
        return Sequence(
            seq_id=self.new_seq_id(),
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
            index=index,
        )

    def check_fits(
        self,
        num_tokens: int,
        max_new_tokens: int,
        num_seqs: int = 1,
        reserve_tokens: int = 0,
        num_seqs_param: str = "n",
        lora_pages: int = 0,
    ) -> None:
        """Raise InvalidParameterError if such a request could never run, even alone.

        `lora_pages`: the pages of the adapter it runs under (0: the base model), which
        share the pool with its KV blocks (in static mode: must fit one slot). The error
        names what to change: `lora_request` when the adapter alone leaves no room,
        `num_seqs_param` (the parameter that asked for `num_seqs` sequences) when one
        sequence would fit, else `max_tokens` when the prompt leaves room for it, else
        `prompt`."""
        total = num_tokens + max_new_tokens
        limit = self.config.max_model_len
        if total > limit:
            raise InvalidParameterError(
                "prompt" if num_tokens >= limit else "max_tokens",
                f"prompt ({num_tokens} tokens) + max_tokens ({max_new_tokens}) = {total} "
                f"exceeds max_model_len ({limit})",
                CONTEXT_LENGTH_EXCEEDED,
            )
        for limit_name, seq_limit in (
            ("max_num_seqs", self.config.max_num_seqs),
            ("max_num_batched_tokens", self.config.max_num_batched_tokens),
        ):
            if num_seqs > seq_limit:
                raise InvalidParameterError(
                    num_seqs_param,
                    f"{num_seqs_param} must be at most {seq_limit} ({limit_name} of this "
                    f"engine), got {num_seqs}",
                )
        # Recomputation after preemption loses sharing: bound without it. A window group
        # holds the most while it computes the longest chunk a step can give.
        usable = self.kv.num_kv_blocks - self.kv.watermark_blocks
        adapters = self.kv.adapters
        if lora_pages and adapters is None:
            raise InvalidParameterError("lora_request", "this engine serves no LoRA adapters")
        if lora_pages and adapters is not None:
            slot = adapters.config.slot_pages if adapters.static else usable - 1
            if lora_pages > slot:
                where = "a static adapter slot" if adapters.static else "the pool"
                raise InvalidParameterError(
                    "lora_request",
                    f"the adapter takes {lora_pages} pages of {self.kv.block_size}-token "
                    f"blocks; {where} leaves {slot} for it",
                    KV_CACHE_EXCEEDED,
                )
            if not adapters.static:
                usable -= lora_pages
        chunk = self.config.max_num_batched_tokens
        needed = num_seqs * self.kv.blocks_for_tokens(total, chunk, reserve_tokens)
        if needed > usable:
            if needed // num_seqs <= usable:
                param = num_seqs_param  # one sequence would fit
            elif self.kv.blocks_for_tokens(num_tokens + 1, chunk, reserve_tokens) <= usable:
                param = "max_tokens"
            else:
                param = "prompt"
            raise InvalidParameterError(
                param,
                f"the request needs up to {needed} KV blocks ({num_seqs} x {total} tokens); "
                f"the pool has {usable} usable blocks of {self.kv.block_size} tokens",
                KV_CACHE_EXCEEDED,
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidParameterError(
                "request_id", f"request id {request.request_id!r} is already in use"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request and free every block it holds at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._running_seq_slots -= req.num_seq_slots
            self.kv.unpin_adapter(req.lora_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        for seq in req.seqs:
            self._free(seq.seq_id)
            self._finished_seq_ids.append(seq.seq_id)
        req.status = RequestStatus.FINISHED
        return req

    def fork(self, req: Request, parent: Sequence, child: Sequence) -> None:
        """Add `child` to the request, sharing every block of `parent`."""
        self.kv.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)

    def finish_seq(self, req: Request, seq: Sequence, keep: bool = True) -> None:
        """A sequence is done: free its blocks; the request ends with its last one.
        `keep=False` forgets it (a pruned beam) instead of keeping it for the output."""
        self._free(seq.seq_id)
        self._finished_seq_ids.append(seq.seq_id)
        req.seqs.remove(seq)
        if keep:
            req.finished_seqs.append(seq)
        if not req.seqs:
            self.running.remove(req)
            self._running_seq_slots -= req.num_seq_slots
            self.kv.unpin_adapter(req.lora_id)
            del self.requests[req.request_id]
            req.status = RequestStatus.FINISHED

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served by the prefix cache / prompt tokens admitted."""
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def num_admissible(self) -> int:
        """How many waiting requests could be admitted now, in queue order, by sequence
        slots and free KV blocks (the watermark and each request's reservation counted;
        unpinned adapters' pages count as free, and each adapter to pin its pages once).
        An estimate from below: prefix-cache hits and chunking can admit more (static
        adapter slots are not counted)."""
        slots = self.config.max_num_seqs - self._running_seq_slots
        blocks = self.kv.num_available_blocks - self.kv.watermark_blocks
        admissible = 0
        pinning: set[int] = set()  # adapters of the requests counted so far
        for req in self.waiting:  # admission is in queue order: stop at the first misfit
            need = len(req.seqs) * self.kv.blocks_for_tokens(
                req.num_tokens, self.config.max_num_batched_tokens, req.reserve_tokens
            )
            if req.lora_id not in pinning:
                need += self.kv.adapter_pages_to_pin(req.lora_id, req.lora_pages)
                pinning.add(req.lora_id)
            if req.num_seq_slots > slots or need > blocks:
                break
            slots -= req.num_seq_slots
            blocks -= need
            admissible += 1
        return admissible

    # --------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._lookahead = {}
        scheduled: dict[str, int] = {}
        drafts: dict[str, tuple[int, ...]] = {}  # request id -> proposals it checks
        preempted: list[str] = []

        # Running requests: decodes first, then partly computed prompts; both in
        # admission order (sorted() is stable).
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            k = len(req.seqs)
            chunk = min(req.num_tokens - req.num_computed_tokens, budget // k)
            draft, req.draft_token_ids = req.draft_token_ids, []
            if chunk <= 0:
                continue
            if draft and chunk == 1 and k == 1 and req.num_computed_tokens + 1 == req.num_tokens:
                # Lookahead slots from free blocks only: when the pool cannot hold them the
                # request decodes one token (its proposals preempt nobody).
                draft = draft[: budget - 1]
                if draft and self._allocate(req, req.num_tokens + len(draft)):
                    drafts[req.request_id] = tuple(draft)
                    scheduled[req.request_id] = 1 + len(draft)
                    budget -= 1 + len(draft)
                    self._claim_lookahead(req, req.num_tokens + len(draft))
                    continue
            while not self._allocate(req, req.num_computed_tokens + chunk):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id) * len(victim.seqs)
                    drafts.pop(victim.request_id, None)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = chunk
                budget -= chunk * k
                self._claim_lookahead(req, req.num_computed_tokens + chunk)

        # New (or preempted) requests, unless this step already had to preempt.
        while self.waiting and budget > 0 and not preempted:
            req = self.waiting[0]
            if self._running_seq_slots + req.num_seq_slots > self.config.max_num_seqs:
                break
            chunk = self._admit(req, budget)
            if chunk == 0:
                break
            self.waiting.popleft()
            self.running.append(req)
            self._running_seq_slots += req.num_seq_slots
            req.status = RequestStatus.RUNNING
            scheduled[req.request_id] = chunk
            budget -= chunk * len(req.seqs)
            self._claim_lookahead(req, req.num_computed_tokens + chunk)

        seqs = []
        lora_pages: dict[int, tuple[int, ...]] = {}
        for request_id, chunk in scheduled.items():
            req = self.requests[request_id]
            if req.lora_id and req.lora_id not in lora_pages:
                assert self.kv.adapters is not None
                lora_pages[req.lora_id] = self.kv.adapters.resident[req.lora_id].pages
            start = req.num_computed_tokens
            draft = drafts.get(request_id, ())
            end = start + chunk - len(draft)
            for seq in req.seqs:
                groups = self.kv.tables[seq.seq_id].groups
                new_block_ids, replaces, edits = self._sent_tables.changes(seq.seq_id, groups)
                seqs.append(
                    ScheduledSeq(
                        request_id=request_id,
                        seq_id=seq.seq_id,
                        token_ids=(*seq.token_ids[start:end], *draft),
                        start_pos=start,
                        new_block_ids=new_block_ids,
                        needs_logits=end == req.num_tokens,
                        draft_token_ids=draft,
                        replaces_tables=replaces,
                        lora_id=req.lora_id,
                        table_edits=edits,
                    )
                )
        # The runner hears of ended sequences (and drops their seeded generators) only
        # through a step it runs: a step with nothing to run keeps them for the next one.
        finished: tuple[int, ...] = ()
        gone: tuple[int, ...] = ()
        loads: tuple[AdapterLoad, ...] = ()
        if seqs:
            finished, self._finished_seq_ids = tuple(self._finished_seq_ids), []
            gone, self._preempted_seq_ids = tuple(self._preempted_seq_ids), []
            loads = self._take_loads()
        return SchedulerOutput(
            seqs=tuple(seqs),
            chunk_sizes=scheduled,
            blocks_to_copy=tuple(self.kv.take_copies()),
            preempted=tuple(preempted),
            finished_seq_ids=finished,
            preempted_seq_ids=gone,
            lora_loads=loads,
            lora_pages=lora_pages,
        )

    def update_from_output(
        self, output: SchedulerOutput, accepted: Mapping[str, list[int]] | None = None
    ) -> None:
        """The step ran: its tokens are computed; full blocks join the prefix cache.

        `accepted`: for a request that checked proposals, the proposals the model kept (a
        prefix of them; none when it is missing). Only its last token and those count as
        computed; the rejected proposals' slots go back to the pool, and the prefix cache
        hashes only the kept tokens."""
        accepted = accepted or {}
        drafts = {s.request_id: s.draft_token_ids for s in output.seqs if s.draft_token_ids}
        for request_id, chunk in output.chunk_sizes.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            draft = drafts.get(request_id, ())
            kept = list(accepted.get(request_id, ())) if draft else []
            if kept != list(draft[: len(kept)]):
                raise ValueError(f"request {request_id}: accepted tokens are not its proposals")
            req.num_computed_tokens += chunk - len(draft) + len(kept)
            lookahead = len(draft) + self._lookahead.get(request_id, 0)
            for seq in req.seqs:
                token_ids: list[int] = seq.token_ids
                if lookahead:
                    self.kv.trim_slots(seq.seq_id, req.num_computed_tokens, lookahead)
                if draft:
                    token_ids = [*seq.token_ids, *kept]
                self.kv.cache_computed_blocks(seq.seq_id, token_ids, req.num_computed_tokens)

    # ---------------------------------------------------------------- helpers
    def _free(self, seq_id: int) -> None:
        """Give the sequence's blocks back; the runner's copy of its tables is forgotten."""
        self.kv.free(seq_id)
        self._sent_tables.forget(seq_id)

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        return all(self.kv.allocate_slots(s.seq_id, num_tokens) for s in req.seqs)

    def _take_loads(self) -> tuple[AdapterLoad, ...]:
        """The adapters loaded since the last step that ran and still in those pages (one
        evicted since is loaded anew, as another AdapterLoad, when next admitted)."""
        loads, self._loads = self._loads, {}
        adapters = self.kv.adapters
        if adapters is None:
            return ()
        return tuple(
            load
            for lora_id, load in loads.items()
            if (resident := adapters.resident.get(lora_id)) is not None
            and resident.pages == load.pages
        )

    def _claim_lookahead(self, req: Request, num_tokens: int) -> None:
        """Claim `req.num_lookahead_tokens` slots past `num_tokens` when the step computes
        up to its last token; from free blocks only (they preempt nobody), else none."""
        n = req.num_lookahead_tokens
        if n and num_tokens >= req.num_tokens and self._allocate(req, num_tokens + n):
            self._lookahead[req.request_id] = n

    def _admit(self, req: Request, budget: int) -> int:
        """Allocate a waiting request's first chunk; the chunk size, or 0 if it must wait."""
        k = len(req.seqs)
        # Prompt log-probabilities need the logits of every prompt position: such a
        # request computes its prompt whole (its blocks still join the cache).
        hits = self.kv.lookup_prefix(
            [s.token_ids for s in req.seqs],
            use_cache=not req.computes_prompt_logprobs,
            lora_id=req.lora_id,
        )
        num_cached = hits[0].num_blocks * self.kv.block_size
        chunk = min(req.num_tokens - num_cached, budget // k)
        if chunk <= 0:
            return 0
        adapters = self.kv.adapters
        loads = req.lora_id and adapters is not None and req.lora_id not in adapters.resident
        ok = self.kv.admit(
            [s.seq_id for s in req.seqs],
            hits,
            num_cached + chunk,
            reserve_tokens=req.reserve_tokens,
            keep_watermark=True,
            lora_id=req.lora_id,
            lora_pages=req.lora_pages,
            lora_path=req.lora_path,
        )
        if not ok:
            return 0
        if loads:
            assert adapters is not None and req.lora_path is not None
            pages = adapters.resident[req.lora_id].pages
            self._loads[req.lora_id] = AdapterLoad(req.lora_id, req.lora_path, pages)
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
            self.prefix_query_tokens += req.num_tokens
            self.prefix_hit_tokens += num_cached
        return chunk

    def preempt(self, req: Request) -> None:
        """Take a running request's blocks back; it waits at the front of the queue and is
        recomputed (keeping its generated tokens) when readmitted."""
        self.running.remove(req)
        self._running_seq_slots -= req.num_seq_slots
        for seq in req.seqs:
            self._free(seq.seq_id)
            self._preempted_seq_ids.append(seq.seq_id)
        self.kv.unpin_adapter(req.lora_id)  # re-pinned (reloaded if evicted) at readmission
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)
