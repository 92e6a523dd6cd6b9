"""`LLM`: serve a hybrid checkpoint from Python, in vLLM's shape.

    llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].outputs[0].text; llm.stats()
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams
from hybridkv.models import load_model
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.engine import Engine
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.profiler import Profile, profile_model
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.snapshot import RequestSnapshot

Prompt = Union[str, Sequence[int]]
_CPU_DEFAULT_BUDGET = 1 << 30


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    table = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16}
    if d not in table:
        raise ValueError(f"dtype={d!r}; choose one of {sorted(table)}")
    return table[d]


class LLM:
    """A model, its dual memory manager and the engine that serves it.

    Keyword arguments beyond the vLLM ones: `checkpoint_policy` ('none' | 'prompt_end' |
    'every_n_blocks' | 'branch_points'), `checkpoint_every_n`, `checkpoint_eviction` ('lru' |
    'flop'), `checkpoint_share` (share of the budget for state checkpoints).
    """

    def __init__(self, model: str, device: str = "cpu", dtype="float32", block_size: int = 16,
                 memory_budget_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, preemption_mode: str = "auto",
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: Optional[int] = None, seed: int = 0, **kwargs):
        self.config = EngineConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, memory_budget_bytes=memory_budget_bytes,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode=preemption_mode, max_model_len=max_model_len,
                                   seed=seed, **kwargs)
        self.model_path = model
        self.model = load_model(model, device=device, dtype=_dtype(dtype))
        if max_model_len is not None:
            self.model.max_model_len = min(self.model.max_model_len or max_model_len, max_model_len)
        self.tokenizer = self.model.tokenizer
        self.profile = profile_model(self.model, block_size, num_tokens=min(256, max_num_batched_tokens))
        specs = self.model.cache_specs()
        c = self.config
        params = sum(p.numel() for p in self.model.parameters())
        self.manager = HybridCacheManager.from_budget(
            specs, self._budget(self.profile), block_size, max_num_seqs, c.checkpoint_share,
            device=self.model.device, enable_prefix_caching=enable_prefix_caching,
            checkpoint_policy=c.checkpoint_policy, checkpoint_every_n=c.checkpoint_every_n,
            checkpoint_eviction=c.checkpoint_eviction, fingerprint=self.model.fingerprint,
            flops_per_token=2.0 * params)
        policy = PreemptionPolicy(preemption_mode, specs, block_size, self.profile, enable_prefix_caching)
        scheduler = Scheduler(self.manager, policy, max_num_batched_tokens, max_num_seqs)
        self.engine = Engine(self.model, self.manager, scheduler, seed=seed)
        self._ids = itertools.count()

    def _budget(self, profile: Profile) -> int:
        if self.config.memory_budget_bytes is not None:
            return self.config.memory_budget_bytes
        dev = self.model.device
        if dev.type != "cuda":
            return _CPU_DEFAULT_BUDGET
        _, total = torch.cuda.mem_get_info(dev)
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(dev) \
            - profile.peak_activation_bytes
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV pool and state slots: {total} bytes x "
                             f"gpu_memory_utilization {self.config.gpu_memory_utilization} minus weights "
                             f"and peak activations ({profile.peak_activation_bytes}) is {budget}")
        return budget

    # ---- requests --------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError; nothing else changes."""
        rid = request_id if request_id is not None else str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        self.engine.add_request(rid, self._token_ids(prompt), params or SamplingParams(), text, priority,
                                cache_salt)
        return rid

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def export_request(self, request_id: str) -> RequestSnapshot:
        return self.engine.export_request(request_id)

    def import_request(self, snapshot: RequestSnapshot) -> None:
        self.engine.import_request(snapshot)

    def stats(self) -> dict:
        return self.engine.stats()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- batch generation ------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, cache_salt: Optional[str] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        token_ids = [self._token_ids(p) for p in prompts]
        for ids, sp in zip(token_ids, params):  # refuse a bad batch before any of it runs
            self.engine.validate(ids, sp)
        ids = [self.add_request(ids if not isinstance(p, str) else p, sp, priority=(priority or [0] * len(prompts))[i],
                                cache_salt=cache_salt)
               for i, (p, ids, sp) in enumerate(zip(prompts, token_ids, params))]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        while len(done) < len(ids) and self.engine.has_unfinished():
            for out in self.engine.step(finished_only=True):
                if out.request_id in ids:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
