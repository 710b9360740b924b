"""Per-request generation parameters. The OpenAI and Ollama front ends both map onto this."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.constraints import Constraint
from kvserve.engine.reasoning import Reasoning

MAX_LOGPROBS = 20
# Temperatures below this sample greedily: dividing logits by a temperature near float32's smallest
# values overflows to inf, and a distribution that sharp is the argmax anyway (vLLM's cut-off too).
GREEDY_BELOW_TEMPERATURE = 1e-5
POOLINGS = (None, "last", "mean", "logits")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` below ``GREEDY_BELOW_TEMPERATURE`` (0 included) means greedy. ``top_k <= 0`` and
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``max_tokens=None`` generates until a stop or the
    context limit."""

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k alternatives
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None  # a grammar the output must follow (JSON schema, regex, ...)
    num_keep: int | None = None  # tokens a context shift keeps at the start (None: the engine's --num-keep)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's logit_bias
    reasoning: Reasoning | None = None  # a thought to follow: its closing tokens forced past its budget
    # code completion: the text ends before its first line (after the first) indented less than this
    # many spaces or tabs (llama.cpp's n_indent: the middle has left the hole); 0: off
    stop_at_dedent: int = 0
    # an embedding request: no token is generated; the prompt's final hidden states pooled ("last": the last
    # token's, "mean": their mean, "logits": the last token's logits) finish it, in RequestOutput.embedding.
    # "mean" reads no prefix cache (it needs every position's state)
    pooling: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids (>= 0) to values in [-100, 100]"),
            (self.num_keep is None or self.num_keep >= 0, f"num_keep must be >= 0, got {self.num_keep}"),
            (self.stop_at_dedent >= 0, f"stop_at_dedent must be >= 0, got {self.stop_at_dedent}"),
            (self.seed is None or -(2**63) <= self.seed < 2**64,
             f"seed must fit in 64 bits, got {self.seed}"),
            (self.pooling in POOLINGS,
             f"pooling must be one of {', '.join(map(str, POOLINGS))}, got {self.pooling!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
