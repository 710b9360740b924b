"""A mixture-of-experts MLP (Qwen3-MoE, OLMoE): a router picks each token's top-k experts.

    router logits = h @ router^T (f32)  ->  softmax over experts  ->  top k  (renormalized to sum 1
    with norm_topk_prob: Qwen3-MoE; as they are: OLMoE)
    out[t] = sum over t's chosen e of weight[t, e] * down_e(act(gate_e(h[t])) * up_e(h[t]))

Each expert's gate_up and down are ``Linear``s in the model's weight format (4-bit / int8 groups / f32),
like a dense MLP's. Tokens are grouped by expert, so a step runs each chosen expert once over its
tokens and never touches the others' weights: a decode step of one sequence reads k experts per layer,
not all of them (``expert_calls`` counts the runs; tests check it).
"""

from __future__ import annotations

from kvserve.lazy_torch import torch
from kvserve.models.activations import gated
from kvserve.models.linear import Linear


class MoE:
    def __init__(self, router: torch.Tensor, gate_up: list[Linear], down: list[Linear], top_k: int,
                 norm_topk_prob: bool, act: str) -> None:
        self.router = router.float().contiguous()  # [num_experts, hidden], f32: routing is not quantized
        self.gate_up, self.down = gate_up, down
        self.top_k, self.norm_topk_prob, self.act = top_k, norm_topk_prob, act
        self.expert_calls = [0] * len(gate_up)  # runs of each expert (one per step that chose it)
        self.bytes_read = 0  # expert weight bytes the runs read

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, hidden] -> (weights f32 [n, k], experts int64 [n, k])."""
        probs = torch.softmax(h.float() @ self.router.t(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, hidden] (normed) -> [n, hidden]."""
        weights, experts = self.route(h)
        flat = experts.flatten()  # [n * k]: token t's choices at t * k .. t * k + k - 1
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // self.top_k
            y = self.down[e](gated(self.gate_up[e](h.index_select(0, tokens)), self.act)).float()
            out.index_add_(0, tokens, y * flat_weights[picks, None])
            self.expert_calls[e] += 1
            self.bytes_read += self.gate_up[e].nbytes + self.down[e].nbytes
        return out.to(h.dtype)
