"""Draft tokens for speculative decoding from a smaller model with the same tokenizer (llama.cpp's
``--model-draft``, vLLM's draft model): the draft reads the request's tokens and guesses the next few
greedily; the engine verifies them in one step as it verifies prompt-lookup drafts
(``speculative.NgramProposer``), so the output is the target's own, sampled tokens included.

The draft keeps a KV cache per request (dense, grown in place) holding the tokens it has read. Each
proposal first drops what the target rejected (the cache is cut back to the longest prefix it shares
with the request's tokens), reads the new tokens in one forward, then runs one forward per guess. It
pays off where the target is much larger than the draft: each guess costs a draft forward, each kept
one saves a target decode step.
"""

from __future__ import annotations

from kvserve.attention.ops import sequence_attention
from kvserve.config import SpeculativeConfig
from kvserve.lazy_torch import inference_mode, torch
from kvserve.models.decoder import DecoderLM
from kvserve.models.loader import LoadedModel

PROBE = "Speculative decoding: the draft 草稿 and the target agree on every token 123, ok?\n"


class DraftKVCache:
    """One sequence's K/V per layer in buffers that double when full; ``truncate`` forgets the tail.
    Implements ``AttentionBackend`` (the dense reference path's attention)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # tokens held (every layer alike once a forward is done)
        self._layer_length = [0] * num_layers

    def attend(self, layer, q, k, v, window, scale, softcap: float | None = None):
        start, end = self._layer_length[layer], self._layer_length[layer] + k.shape[0]
        if self.keys[layer] is None or self.keys[layer].shape[0] < end:
            capacity = max(2 * end, 64)
            keys, values = k.new_empty(capacity, *k.shape[1:]), v.new_empty(capacity, *v.shape[1:])
            if start:
                keys[:start], values[:start] = self.keys[layer][:start], self.values[layer][:start]
            self.keys[layer], self.values[layer] = keys, values
        self.keys[layer][start:end], self.values[layer][start:end] = k, v
        self._layer_length[layer] = end
        self.length = end
        keys, values = self.keys[layer][:end].transpose(0, 1), self.values[layer][:end].transpose(0, 1)
        return sequence_attention(q, keys, values, start, window, scale, softcap)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
        self._layer_length = [min(n, length) for n in self._layer_length]


class _DraftState:
    __slots__ = ("cache", "tokens")

    def __init__(self, num_layers: int) -> None:
        self.cache = DraftKVCache(num_layers)
        self.tokens: list[int] = []  # what the cache holds


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, draft: LoadedModel) -> None:
        self.k = config.num_speculative_tokens
        self.model: DecoderLM = draft.model
        self._states: dict[str, _DraftState] = {}

    @classmethod
    def load(cls, config: SpeculativeConfig, target: LoadedModel, weight_format: str) -> DraftModelProposer:
        """The draft named by ``config.draft_model``, on the target's device, checked against the
        target's tokenizer (ValueError where they differ)."""
        from kvserve.models.loader import load_model

        draft = load_model(config.draft_model, device=str(target.model.device), weight_format=weight_format)
        check_same_tokenizer(target, draft)
        return cls(config, draft)

    @inference_mode
    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` greedy guesses of the draft after ``tokens``."""
        if limit < 1:
            return []
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _DraftState(self.model.config.num_layers)
        held = 0
        for a, b in zip(state.tokens, tokens, strict=False):
            if a != b:
                break
            held += 1
        held = min(held, len(tokens) - 1)  # at least one token to read: its logits give the first guess
        state.cache.truncate(held)
        new = tokens[held:]
        guesses: list[int] = []
        device = self.model.device
        while True:
            positions = torch.arange(held, held + len(new), device=device)
            hidden = self.model.forward(torch.tensor(new, device=device), positions, state.cache)
            guess = int(self.model.compute_logits(hidden[-1:]).argmax())
            held += len(new)
            guesses.append(guess)
            if len(guesses) == min(self.k, limit):
                break
            new = [guess]
        state.tokens = tokens + guesses[:-1]  # the last guess was not read
        return guesses

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """Nothing to adapt: the draft guesses the next few tokens whatever the last ones did."""

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Drafts are token ids: the draft must read and write the target's. Compared by vocabulary size
    and by the ids both give a probe text (code, CJK, digits)."""
    sizes = target.config.vocab_size, draft.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft model's vocabulary has {sizes[1]} tokens, the model's {sizes[0]}: "
                         "a draft model must share the model's tokenizer")
    if (target.tokenizer is not None and draft.tokenizer is not None
            and target.tokenizer.encode(PROBE) != draft.tokenizer.encode(PROBE)):
        raise ValueError("the draft model's tokenizer splits text differently from the model's: "
                         "a draft model must share the model's tokenizer")
