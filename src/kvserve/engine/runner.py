"""Owns the model and the paged KV tensors; turns a ``SchedulerOutput`` into logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice, build_decode_batch
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import PagedKVStorage
from kvserve.models import native_step
from kvserve.models.decoder import DecoderLM
from kvserve.models.native_step import StepDecodes, StepSequence

if TYPE_CHECKING:  # the one-call step needs no torch: the torch forward imports it
    import torch


class ModelRunner:
    def __init__(self, model: DecoderLM, storage: PagedKVStorage, kv: KVCacheManager, num_ctx: int) -> None:
        self.model = model
        self.num_ctx = num_ctx  # LongRoPE's factors follow the context served (rope.fit_context)
        self.storage = storage
        self.kv = kv
        self.device = model.device
        self.block_size = storage.block_size
        # the whole forward in one native call where it applies
        self.native_step = native_step.for_model(model, storage)

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], np.ndarray]:
        """Run one forward over every scheduled token. Returns the requests whose known tokens are now
        all computed, with their last-position logits ([len(ready), vocab] float32 numpy, what the
        sampler reads); a request with speculative drafts has one row more per draft, right after its
        own. A pooling request (``params.pooling``) is not among them: its final hidden states are pooled
        into it, and once its prompt is read its ``embedding`` is set."""
        # every step, as engines of other contexts may share the model: a no-op unless LongRoPE switches
        self.model.fit_context(self.num_ctx)
        step = StepInputs(range(len(self.storage.kv_group_blocks)))
        for s in out.scheduled:
            self._add(step, s)
        if self.native_step is not None:
            hidden = self._native_forward(step)
            if step.pooling:  # pooling requests (an embedding model) keep their torch states
                hidden = _as_tensor(hidden)
        else:
            hidden = self._forward(step)
        for r, row, n in step.pooling:
            pooled = _pool(r, hidden[row : row + n])
            if pooled is not None:
                r.embedding = pooled.float().cpu()
        if not step.logit_rows:
            return [], np.empty((0, 0), np.float32)
        logits = self._logits(hidden, step.logit_rows)
        if step.pooled_logits:
            for r, i in step.pooled_logits:
                r.embedding = _as_tensor(logits[i].copy())
            taken = {i for _, i in step.pooled_logits}
            logits = logits[[i for i in range(len(step.logit_rows)) if i not in taken]]
        return step.ready, logits

    def _logits(self, hidden, rows: list[int]) -> np.ndarray:
        """The logits of ``rows`` of the final hidden states (numpy from the one-call step, else torch)."""
        if isinstance(hidden, np.ndarray):
            return self.native_step.logits(hidden[rows])
        import torch

        index = torch.tensor(rows, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index)).float().cpu().numpy()

    def _add(self, step: StepInputs, s: ScheduledRequest) -> None:
        """One scheduled request's tokens, slots, attention rows and outputs, appended to the step."""
        bs = self.block_size
        r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
        tables = self.kv.kv_group_block_ids(r.request_id)
        end = start + n
        step.input_ids.extend(r.all_token_ids[start:end] + s.draft_token_ids if s.draft_token_ids
                              else r.all_token_ids[start:end])
        step.positions.extend(range(start, end))
        for g in step.kv_groups:
            step.slots[g].extend(tables[g][p // bs] * bs + p % bs for p in range(start, end))
        first_row = len(step.input_ids) - n
        if s.draft_token_ids:  # each a decode row of its own: the bits decoding one at a time gives
            for p in range(start, end):
                step.add_decode(tables, first_row + p - start, p // bs + 1, p + 1)
                step.logit_rows.append(first_row + p - start)
            step.ready.append(r)
            return
        # generated tokens are attended together in one padded call (the decode kernel); a prompt
        # chunk of one token goes with the prompts, so that it gets the bits a whole prefill gives
        num_blocks = -(-end // bs)
        if n == 1 and end > r.num_prompt_tokens:
            step.add_decode(tables, first_row, num_blocks, end)
        else:
            step.sequences.append(StepSequence(first_row, n, start, [tables[g][:num_blocks]
                                                                     for g in step.kv_groups]))
        last_row = len(step.input_ids) - 1
        if r.params.pooling == "logits":  # its last row's logits, computed with the sampled requests'
            if end == r.num_prompt_tokens:
                step.pooled_logits.append((r, len(step.logit_rows)))
                step.logit_rows.append(last_row)
        elif r.params.pooling is not None:
            step.pooling.append((r, first_row, n))
        elif end == r.num_tokens:
            step.logit_rows.append(last_row)
            step.ready.append(r)

    def _native_forward(self, step: StepInputs) -> np.ndarray:
        """The final hidden states of every row in one native call, from numpy inputs (no torch)."""
        slot_rows = [self.storage.slot_rows(np.array(step.slots[g], dtype=np.int64), g)
                     for g in step.kv_groups]
        decodes = StepDecodes(step.decode_rows, step.decode_tables, step.decode_lens)
        ids, positions = (np.array(values, dtype=np.int64) for values in (step.input_ids, step.positions))
        return self.native_step(ids, positions, slot_rows, decodes, step.sequences)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The final hidden states of every row: the model's forward over the paged attention."""
        import torch

        device, kv_groups = self.device, step.kv_groups
        kv_group_slots = tuple(torch.tensor(step.slots[g], dtype=torch.long,
                                            device=device) for g in kv_groups)
        ids = torch.tensor(step.input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(step.positions, dtype=torch.long, device=device)
        decodes = None
        if step.decode_rows:
            decodes = build_decode_batch(step.decode_rows, step.decode_tables, step.decode_lens, device,
                                         len(step.input_ids))
        sequences = [SequenceSlice(s.first_row, s.rows, s.position + s.rows, tuple(
            torch.tensor(t, dtype=torch.long, device=device) for t in s.tables)) for s in step.sequences]
        metadata = PagedAttentionMetadata(kv_group_slots, sequences=sequences, decodes=decodes)
        return self.model.forward(ids, pos, PagedAttention(self.storage, metadata))


class StepInputs:
    """One step's inputs, gathered once from the scheduler's output (nano-vllm's ``prepare_prefill`` and
    ``prepare_decode`` in one): rows are tokens in scheduled order; per KV group (every layer's blocks,
    then the sliding layers') each token's slot and each decode row's block table."""

    def __init__(self, kv_groups: range) -> None:
        self.kv_groups = kv_groups
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[list[int]] = [[] for _ in kv_groups]
        self.sequences: list[StepSequence] = []  # prompt chunks, attended by the prefill path
        self.decode_rows: list[int] = []  # rows attended by the decode kernel, one query each
        self.decode_tables: list[list[list[int]]] = [[] for _ in kv_groups]
        self.decode_lens: list[int] = []
        self.logit_rows: list[int] = []  # rows whose logits are computed
        self.ready: list[Request] = []  # the requests those logits are sampled for, in order
        self.pooling: list[tuple[Request, int, int]] = []  # (request, its first row, rows)
        self.pooled_logits: list[tuple[Request, int]] = []  # a "logits" pooling request's place in logit_rows

    def add_decode(self, tables: list[list[int]], row: int, blocks: int, context: int) -> None:
        self.decode_rows.append(row)
        for g in self.kv_groups:
            self.decode_tables[g].append(tables[g][:blocks])
        self.decode_lens.append(context)


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(a)


def _pool(request: Request, hidden: torch.Tensor) -> torch.Tensor | None:
    """Fold one chunk's final hidden states ([n, hidden], the chunk ending at the request's computed count
    plus n) into a "last" or "mean" pooling request; after the prompt's last chunk, the pooled state."""
    if request.params.pooling == "mean":
        # the chunks' rows are summed together at the end, not chunk by chunk: the same sum, in the same
        # order, whichever chunks the scheduler cut (a recompute starts over: ``Request.restart``)
        request.pooled_rows.append(hidden.float())
    # the computed count is not advanced yet: the scheduler does after the step
    if request.num_computed_tokens + len(hidden) < request.num_prompt_tokens:
        return None
    if request.params.pooling == "last":
        return hidden[-1]
    import torch

    rows, request.pooled_rows = request.pooled_rows, []
    return (rows[0] if len(rows) == 1 else torch.cat(rows)).sum(0) / request.num_prompt_tokens
