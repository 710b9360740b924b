"""Owns the model and the paged KV tensors; turns a ``SchedulerOutput`` into logits."""

from __future__ import annotations

import torch

from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice, build_decode_batch
from kvserve.engine.request import Request
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import PagedKVStorage
from kvserve.models import native_decode
from kvserve.models.decoder import DecoderLM


class ModelRunner:
    def __init__(self, model: DecoderLM, storage: PagedKVStorage, kv: KVCacheManager, num_ctx: int) -> None:
        self.model = model
        self.num_ctx = num_ctx  # LongRoPE's factors follow the context served (rope.fit_context)
        self.storage = storage
        self.kv = kv
        self.device = model.device
        self.block_size = storage.block_size
        # steps of single-token sequences only: the whole forward in one native call where it applies
        self.native_decode = native_decode.for_model(model, storage)

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one forward over every scheduled token. Returns the requests whose known tokens are now
        all computed, with their last-position logits ([len(ready), vocab] float32); a request with
        speculative drafts has one row more per draft, right after its own. A pooling request
        (``params.pooling``) is not among them: its final hidden states are pooled into it, and once its
        prompt is read its ``embedding`` is set."""
        # every step, as engines of other contexts may share the model: a no-op unless LongRoPE switches
        self.model.fit_context(self.num_ctx)
        input_ids: list[int] = []
        positions: list[int] = []
        kv_groups = range(len(self.storage.kv_group_blocks))  # every layer's blocks, then the sliding layers'
        slots: list[list[int]] = [[] for _ in kv_groups]  # per group, each token's slot
        sequences: list[SequenceSlice] = []
        logit_rows: list[int] = []
        ready: list[Request] = []
        bs = self.block_size
        decode_rows: list[int] = []
        decode_tables: list[list[list[int]]] = [[] for _ in kv_groups]  # per group, each decode's table
        decode_lens: list[int] = []
        pooling: list[tuple[Request, int, int]] = []  # (request, its first row, rows)
        pooled_logits: list[tuple[Request, int]] = []  # a "logits" pooling request's place among logit_rows

        def decode(row: int, blocks: int, context: int) -> None:
            decode_rows.append(row)
            for g in kv_groups:
                decode_tables[g].append(tables[g][:blocks])
            decode_lens.append(context)

        for s in out.scheduled:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            tables = self.kv.kv_group_block_ids(r.request_id)
            end = start + n
            num_blocks = -(-end // bs)
            input_ids.extend(r.all_token_ids[start:end] + s.draft_token_ids if s.draft_token_ids
                             else r.all_token_ids[start:end])
            positions.extend(range(start, end))
            for g in kv_groups:
                slots[g].extend(tables[g][p // bs] * bs + p % bs for p in range(start, end))
            if s.draft_token_ids:  # each a decode row of its own: the bits decoding one at a time gives
                for p in range(start, end):
                    decode(len(input_ids) - end + p, p // bs + 1, p + 1)
                    logit_rows.append(len(input_ids) - end + p)
                ready.append(r)
                continue
            # generated tokens are attended together in one padded call (the decode kernel); a prompt
            # chunk of one token goes with the prompts, so that it gets the bits a whole prefill gives
            if n == 1 and end > r.num_prompt_tokens:
                decode(len(input_ids) - 1, num_blocks, end)
            else:
                sequences.append(SequenceSlice(len(input_ids) - n, n, end, tuple(
                    torch.tensor(tables[g][:num_blocks], dtype=torch.long, device=self.device) for g in kv_groups)))
            if r.params.pooling == "logits":  # its last row's logits, computed with the sampled requests'
                if end == r.num_prompt_tokens:
                    pooled_logits.append((r, len(logit_rows)))
                    logit_rows.append(len(input_ids) - 1)
            elif r.params.pooling is not None:
                pooling.append((r, len(input_ids) - n, n))
            elif end == r.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                ready.append(r)
        device = self.device
        decodes = None
        if decode_rows:
            decodes = build_decode_batch(decode_rows, decode_tables, decode_lens, device, len(input_ids))
        kv_group_slots = tuple(torch.tensor(slots[g], dtype=torch.long, device=device) for g in kv_groups)
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        if decodes is not None and decodes.only_decodes and self.native_decode is not None:
            hidden = self.native_decode(ids, pos, [decodes.tables(g) for g in kv_groups], decodes.context_lens,
                                        [self.storage.slot_rows(kv_group_slots[g], g) for g in kv_groups])
        else:
            metadata = PagedAttentionMetadata(kv_group_slots, sequences, decodes)
            hidden = self.model.forward(ids, pos, PagedAttention(self.storage, metadata))
        for r, row, n in pooling:
            pooled = _pool(r, hidden[row : row + n])
            if pooled is not None:
                r.embedding = pooled.float().cpu()
        if not logit_rows:
            return [], hidden.new_empty((0, 0))
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(logit_rows, device=device)))
        if pooled_logits:
            for r, i in pooled_logits:
                r.embedding = logits[i].float().cpu()
            taken = {i for _, i in pooled_logits}
            logits = logits[[i for i in range(len(logit_rows)) if i not in taken]]
        return ready, logits


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
    rows, request.pooled_rows = request.pooled_rows, []
    return (rows[0] if len(rows) == 1 else torch.cat(rows)).sum(0) / request.num_prompt_tokens
