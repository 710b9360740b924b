"""``LLMEngine``: add requests, call ``step`` until done, read ``RequestOutput``s. Synchronous."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import numpy as np

from kvserve import native
from kvserve.config import EngineConfig
from kvserve.engine.constraints import GrammarError, GrammarTokenizer, TokenConstraint
from kvserve.engine.heap import HeapWatch, keep_freed_pages
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.runner import ModelRunner
from kvserve.engine.sampler import Sampler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.speculative import NgramProposer
from kvserve.errors import PromptTooLongError
from kvserve.kv.cache import KVCache
from kvserve.kv.cache_types import kv_bytes_per_token
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.events import KVEvent, KVEventLog
from kvserve.kv.groups import WindowGroup
from kvserve.kv.hashing import PROCESS_KEY, cache_key
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import DiskOffload
from kvserve.kv.pool_sizing import pool_size
from kvserve.kv.storage import UNCENTRED_KEYS, PagedKVStorage
from kvserve.kv.type_choice import context_advice
from kvserve.models.fingerprint import model_fingerprint
from kvserve.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3  # a request in this many failed steps fails, even when never alone in one


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        keep_freed_pages()
        self.heap = HeapWatch()
        self.config = config
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        size = pool_size(loaded.config, config.cache, config.scheduler.max_num_seqs,
                         config.scheduler.max_num_batched_tokens)
        self.max_model_len = size.max_model_len
        quantized_keys = config.cache.cache_type_k not in UNCENTRED_KEYS  # else nothing to centre or balance
        self.storage = PagedKVStorage(
            loaded.config, size.num_blocks, config.cache.block_size, config.cache.cache_type_k,
            loaded.model.device, config.cache.cache_type_v, size.window_layers, size.num_window_blocks,
            **(loaded.model.key_transforms() if quantized_keys and hasattr(loaded.model, "key_transforms")
               else {}),
        )
        self._identity: dict | None = None
        self.disk: DiskTier | None = None
        self.offload: DiskOffload | None = None
        hash_key = PROCESS_KEY
        if config.cache.disk_cache_dir and config.cache.enable_prefix_caching:
            try:
                self.disk = DiskTier(config.cache.disk_cache_dir, config.cache.disk_cache_size,
                                     self.cache_identity)
            except OSError as e:
                raise ValueError(
                    f"cannot use {config.cache.disk_cache_dir} as the disk KV cache: {e}"
                ) from None
            self.offload = DiskOffload(self.storage, self.disk)
            hash_key = cache_key(self.disk.secret, self.cache_identity)
        groups = ()
        if size.window_layers:
            groups = (WindowGroup(self.storage.window_kv_group, size.num_window_blocks,
                                  config.cache.block_size, loaded.config.sliding_window,
                                  config.cache.enable_prefix_caching),)
        self.kv = KVCacheManager(size.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 hash_key, self.offload, groups)
        # the cache as one typed object, for what reads and writes its blocks outside the engine (prompt-cache
        # files)
        self.cache = KVCache(self.kv, self.storage, lambda: self.cache_identity, loaded.config.vocab_size,
                             self.offload)
        self.scheduler = Scheduler(config.scheduler, self.kv, size.max_model_len,
                                   self._proposer(config, loaded))
        self.num_draft_tokens = 0  # speculative tokens proposed, verified and kept (all requests)
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0  # request-steps that verified drafts
        self.runner = ModelRunner(loaded.model, self.storage, self.kv, size.max_model_len)
        decode = (lambda i: self.tokenizer.decode([i], skip_special_tokens=False)) if self.tokenizer else str
        self.sampler = Sampler(decode)
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammar_tokenizer = GrammarTokenizer(self.tokenizer) if self.tokenizer else None
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else ()
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._kv_event_sink: Callable[[list[KVEvent]], None] | None = None

    @staticmethod
    def _proposer(config: EngineConfig, loaded: LoadedModel):
        """Speculative decoding's drafts: prompt lookup, a draft model (in the target's weight format),
        or None."""
        spec = config.speculative
        if spec.method == "ngram":
            return NgramProposer(spec)
        if spec.method == "draft":
            from kvserve.engine.draft_model import DraftModelProposer

            return DraftModelProposer.load(spec, loaded, loaded.model.weight_format)
        return None

    @classmethod
    def from_config(cls, config: EngineConfig, progress=None, auto_pull: bool = False) -> LLMEngine:
        if config.num_threads:
            native.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.device, config.dtype, progress, auto_pull=auto_pull,
                            weight_format=config.weights)
        return cls(config, loaded)

    # --- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids")
            return self.tokenizer.encode(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return [int(t) for t in prompt]

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate a request without touching engine state (safe from any thread).
        Raises ValueError or PromptTooLongError."""
        params = params or SamplingParams()
        request = Request(
            request_id if request_id is not None else f"req-{next(self._ids)}",
            self.scheduler.fit_prompt(self.tokenize_prompt(prompt), params.num_keep, params.pooling),
            params,
            self.max_model_len,
            self.eos_token_ids,
            cache_salt,
            shift_context=self.scheduler.shifts_context,
        )
        self._check_prompt(request)
        if request.params.constraint is not None:
            if self.grammar_tokenizer is None:
                raise ValueError("this model has no tokenizer, which constrained output needs")
            request.constraint = TokenConstraint(request.params.constraint, self.grammar_tokenizer)
            request.metrics.constrained = True
        return request

    def _check_prompt(self, request: Request) -> None:
        try:
            self.scheduler.check_prompt(request)
        except PromptTooLongError as e:
            cache = self.config.cache
            advice = context_advice(self.model_config, e.num_prompt_tokens, cache.cache_type_k,
                                    cache.cache_type_v_resolved)
            raise PromptTooLongError(f"{e}; {advice}", e.num_prompt_tokens, e.limit) from None

    def add_prepared(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        self.outputs.add(request)
        return request

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        return self.add_prepared(self.make_request(prompt, params, request_id, cache_salt))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.metrics.finished_time = time.perf_counter()
        return self.outputs.process(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # --- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            if self._kv_event_sink is not None:
                self.flush_kv_events()

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        now = time.perf_counter()
        for s in out.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        try:
            ready, logits = self.runner.execute(out)
        except Exception as e:  # noqa: BLE001 - a kernel's MemoryError, a bug: the step's requests pay
            return self._step_failed(out, e)
        self.scheduler.step_succeeded(out)
        self.scheduler.update_after_step(out)
        self.heap.after_step(out.num_tokens)
        if self.offload is not None:
            self.offload.save_computed(self.kv, [s.request for s in out.scheduled])
        rows = logits if ready else None  # numpy f32: the runner's rows, copied over once from a GPU
        return self._sampled_outputs(out, ready, rows) + self._pooled_outputs(out)

    def _sampled_outputs(self, out: SchedulerOutput, ready: list[Request],
                         logits: np.ndarray | None) -> list[RequestOutput]:
        """Draw each ready request's next token (and check its drafts), then its output; a request whose
        draw fails ends with an error, the others go on."""
        drafts = {s.request.request_id: s.draft_token_ids for s in out.scheduled if s.draft_token_ids}
        first_rows, row = [], 0  # each ready request's first logits row (a request with drafts has more)
        for r in ready:
            first_rows.append(row)
            row += 1 + len(drafts.get(r.request_id, ()))
        firsts = logits
        if row != len(ready):
            firsts = logits[first_rows]
        sampled = self.sampler.sample(firsts, ready) if ready else []
        now = time.perf_counter()
        results = []
        for request, first, (token, logprob) in zip(ready, first_rows, sampled, strict=True):
            if not isinstance(token, Exception):
                self._take_token(request, token, logprob, now)
                if request.request_id in drafts:
                    self._verify(request, drafts[request.request_id], logits, first, token, now)
            if isinstance(token, Exception) or request.error is not None:
                if isinstance(token, GrammarError):
                    request.error, request.error_status = str(token), 400
                request.error = request.error or f"sampling failed: {token}"
                request.status = RequestStatus.FINISHED_ERROR
            output = self.outputs.process(request)
            if request.is_finished:
                request.metrics.finished_time = now
                self.scheduler.finish(request, request.status)
            results.append(output)
        return results

    def _pooled_outputs(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Pooling requests whose whole prompt is read: their embedding ends them."""
        now = time.perf_counter()
        results = []
        for s in out.scheduled:
            request = s.request
            if request.embedding is not None and not request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
                request.metrics.first_token_time = request.metrics.finished_time = now
                self.num_prompt_tokens += request.num_prompt_tokens
                results.append(self.outputs.process(request))
                self.scheduler.finish(request, request.status)
        return results

    def _take_token(self, request: Request, token: int, logprob, now: float) -> None:
        self._record_token(request, token, logprob, now)
        request.check_stop_token()
        if request.constraint is not None and request.constraint.complete and not request.is_finished:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None

    def _verify(self, request: Request, draft: list[int], logits: np.ndarray, first: int, token: int,
                now: float) -> None:
        """Keep the drafts that equal the tokens drawn at their positions, one position at a time (each
        draw sees the tokens before it, as decoding one token at a time does); the first token that
        differs, or the one after the last draft, is the step's last. Drafts past it are dropped: their
        K/V lies beyond the computed tokens and is written over."""
        accepted = 0
        while accepted < len(draft) and token == draft[accepted] and not request.is_finished:
            accepted += 1
            ((token, logprob),) = self.sampler.sample(logits[first + accepted : first + accepted + 1],
                                                      [request])
            if isinstance(token, Exception):
                request.error = str(token) if isinstance(token, GrammarError) else f"sampling failed: {token}"
                request.error_status = 400 if isinstance(token, GrammarError) else 500
                break
            self._take_token(request, token, logprob, now)
        request.num_computed_tokens += accepted
        self.scheduler.proposer.record(request.request_id, len(draft), accepted)
        request.metrics.num_draft_tokens += len(draft)
        request.metrics.num_accepted_tokens += accepted
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        self.num_verify_steps += 1

    def _step_failed(self, out, error: Exception) -> list[RequestOutput]:
        """The forward raised: the step is undone and its requests run again, each alone when there
        were several; a request that fails alone (or in MAX_STEP_FAILURES steps) finishes with an
        error of its own. Nothing else is touched: the engine keeps serving."""
        log.error("engine step with %d request(s) failed: %r", len(out.scheduled), error)
        self.scheduler.roll_back(out)
        now = time.perf_counter()
        results = []
        for s in out.scheduled:
            request = s.request
            request.num_step_failures += 1
            if len(out.scheduled) == 1 or request.num_step_failures >= MAX_STEP_FAILURES:
                request.error = f"the engine step failed: {error!r}"
                request.metrics.finished_time = now
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                results.append(self.outputs.process(request))
        return results

    def _record_token(self, request: Request, token: int, logprob, now: float) -> None:
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.num_prompt_tokens += request.num_prompt_tokens
        else:
            m.itls.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += 1
        self.num_generated_tokens += 1
        request.append_token(token)
        if logprob is not None:
            request.logprobs.append(logprob)

    def run_to_completion(self) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return final

    def publish_kv_events(self, sink: Callable[[list[KVEvent]], None]) -> None:
        """From now on, hand ``sink`` the prefix cache's events (``kv.events``) after every step,
        starting with the blocks cached already. The sink runs on the engine's thread: it must not block."""
        self.kv.full.pool.events = KVEventLog("GPU" if self.loaded.model.device.type == "cuda" else "CPU")
        self.kv.full.pool.record_cached()
        self._kv_event_sink = sink
        self.flush_kv_events()

    def flush_kv_events(self) -> None:
        pending = self.kv.full.pool.events
        if self._kv_event_sink is not None and pending is not None and pending.events:
            self._kv_event_sink(pending.take())

    def close(self) -> None:
        """Finish the disk tier's writes (the engine is unusable afterwards only for new disk writes)."""
        if self.disk is not None:
            self.disk.close()

    # --- views ----------------------------------------------------------------------------------------
    @property
    def cache_identity(self) -> dict:
        """Everything that makes this engine's K/V for given tokens what they are: blocks are shared
        (through the disk tier or prompt-cache files) only between engines with equal identities."""
        if self._identity is None:
            model = self.loaded.model
            self._identity = {
                "format": 1,
                "model": model_fingerprint(self.loaded.path),
                "config": repr(self.model_config),
                "weights": model.weight_format,
                "dtype": model.dtype_name,
                "device": model.device.type,
                "kernels": self.kernels,
                "layout": self.storage.layout(),
            }
            factors = model.rope.factors_for(self.max_model_len)
            if factors is not None:  # LongRoPE: the factor set the keys are rotated with
                self._identity["rope_factors"] = factors
        return self._identity

    @property
    def kernels(self) -> str:
        """The CPU kernel path the model runs on (``native.kernel_path``), or "torch" off the CPU."""
        return native.kernel_path() if self.loaded.model.device.type == "cpu" else "torch"

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config, self.config.cache.cache_type_k,
                                  self.config.cache.cache_type_v)

    @property
    def kv_pool_bytes(self) -> int:
        return self.storage.nbytes

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
