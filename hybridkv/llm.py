"""`LLM`: serve a hybrid checkpoint from Python, in vLLM's shape.

    llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].outputs[0].text; llm.stats()
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.chat_template import Conversation, chat_prompt_ids
from hybridkv.cpu_threads import configure_cpu_threads
from hybridkv.outputs import RequestOutput
from hybridkv.prompts import Prompt, is_one_prompt, parse_prompt
from hybridkv.sampling_params import SamplingParams
from hybridkv.models import load_model
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.decode_graphs import DecodeGraphs
from hybridkv.scheduler.decode_graphs import check_option as check_graphs_option
from hybridkv.scheduler.engine import Engine
from hybridkv.scheduler.hit_guard import HitGuard
from hybridkv.scheduler.speculation import Speculation
from hybridkv.speculative.draft_model import DRAFT_BUDGET_SHARE, DraftModelDrafter
from hybridkv.speculative.mtp import MtpDrafter
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.profiler import Profile, profile_model
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.snapshot import RequestSnapshot
from hybridkv.specs import with_cache_dtypes

log = logging.getLogger("hybridkv.llm")
_CPU_DEFAULT_BUDGET = 1 << 30


@dataclasses.dataclass
class QueuedRequest:
    """One sequence the engine holds, as a load balancer sees it (`LLM.queued`); read-only."""

    request_id: Hashable          # the sequence's id: a request's id for its first sequence
    status: str                   # "running", "waiting" or "swapped"
    token_ids: Sequence[int]      # prompt + generated so far (the engine's own list: do not change it)
    cache_salt: Optional[str]
    tokens_left: int              # output tokens it may still generate
    num_seqs: int                 # sequences of its request (n > 1, forks); only a single one can move
    finished: bool


def _dtype(d):
    """LLM's dtype -> a torch.dtype, or "auto": the checkpoint's config.json dtype (float32 when it
    names none), which load_model resolves. ValueError naming the accepted names, before loading."""
    from hybridkv.models.loader import parse_dtype

    return parse_dtype(d)


class LLM:
    """A model, its dual memory manager and the engine that serves it.

    Keyword arguments beyond the vLLM ones: `checkpoint_policy` ('junctions' (default) | 'none' |
    'prompt_end' | 'every_n_blocks' | 'branch_points'), `checkpoint_every_n`, `checkpoint_eviction`
    ('utility' (default) | 'lru' | 'flop'), `checkpoint_share` (share of the budget for state
    checkpoints), `host_cache_bytes` (a host tier for checkpoints evicted from the device),
    `disk_cache_dir` / `disk_cache_bytes` (a disk tier of KV and states that survives restarts;
    `disk_read_ahead=False` reads its files in the admission, on the step's thread, not ahead of it),
    `verify_cache_hits` (the fraction of prefix hits recomputed cold and compared). docs/design.md and BENCHMARKS.md say what each does.
    `tensor_parallel_size` N > 1 shards the model and its pools over N ranks (this process is rank
    0; hybridkv/parallel/); `close()` stops the other ranks.
    `cuda_graphs=True` replays decode steps as CUDA graphs (scheduler/decode_graphs.py; off by
    default: never run on a GPU yet); refused on a CPU ('dry_run' is the tests' CPU stand-in).
    `speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}` (vLLM's shape; methods 'ngram', 'draft_model' with "model", 'mtp':
    the checkpoint's own MTP head) makes decodes verify drafted tokens, k + 1 positions in one
    forward, with the output token for token what it would be without (docs/design.md,
    "Speculative decoding").
    """

    def __init__(self, model: str, device: str = "auto", dtype="float32", block_size: int = 16,
                 memory_budget_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, preemption_mode: str = "auto",
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: Optional[int] = None, seed: int = 0, tensor_parallel_size: int = 1,
                 **kwargs):
        _check_keywords(kwargs)
        from hybridkv.models.loader import resolve_device
        from hybridkv.parallel import ShardLoad, TensorParallel, check_size

        device = resolve_device(device)  # "auto" -> cuda when torch sees a GPU, else cpu
        check_size(tensor_parallel_size, device)  # before anything loads
        self.config = EngineConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, memory_budget_bytes=memory_budget_bytes,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode=preemption_mode, max_model_len=max_model_len,
                                   seed=seed, **kwargs)
        graph_mode = check_graphs_option(self.config.cuda_graphs, device, tensor_parallel_size)
        quantized = (self.config.kv_cache_dtype, self.config.state_cache_dtype) != ("auto", "auto")
        if self.config.disk_cache_dir is not None and tensor_parallel_size != 1:
            raise ValueError("disk_cache_dir runs without tensor parallelism in this version (the pools are "
                             "sharded over ranks); drop one of them")
        if quantized and (tensor_parallel_size != 1 or graph_mode is not None):
            raise ValueError("kv_cache_dtype / state_cache_dtype other than 'auto' run without tensor parallelism "
                             "and without CUDA graphs in this version; drop one of them")
        spec = self.config.speculative_config
        with_mtp = spec is not None and spec.method == "mtp"
        if with_mtp and (tensor_parallel_size != 1 or graph_mode is not None or quantized):
            raise ValueError("speculative method 'mtp' runs without tensor parallelism, CUDA graphs and quantized "
                             "caches in this version (the head runs eagerly after each step's forward); drop one")
        self.model_path = model
        shard = ShardLoad(0, tensor_parallel_size) if tensor_parallel_size != 1 else None  # rank 0's rows only
        self.model = load_model(model, device=device, dtype=_dtype(dtype), max_model_len=max_model_len,
                                shard=shard, with_mtp=with_mtp)
        configure_cpu_threads(self.model.device)  # measured default; HYBRIDKV_CPU_THREADS overrides
        self.tensor_parallel = None  # ranks 1..N-1 hold the other shards (hybridkv/parallel/)
        if tensor_parallel_size != 1:
            self.tensor_parallel = TensorParallel(
                self.model, model, tensor_parallel_size, dtype=_dtype(dtype), max_model_len=max_model_len,
                block_size=block_size, profile_tokens=(min(256, max_num_batched_tokens), max_num_batched_tokens),
                shard=shard)
        if max_model_len is not None:
            self.model.max_model_len = min(self.model.max_model_len or max_model_len, max_model_len)
        self.tokenizer = self.model.tokenizer
        self.profile = profile_model(self.model, block_size, num_tokens=min(256, max_num_batched_tokens),
                                     peak_tokens=max_num_batched_tokens)
        c = self.config
        specs = with_cache_dtypes(self.model.cache_specs(), c.kv_cache_dtype, c.state_cache_dtype)  # checked by EngineConfig
        params = sum(p.numel() for p in self.model.parameters())
        budget = self._budget(self.profile)
        spec = c.speculative_config
        draft_budget = budget // DRAFT_BUDGET_SHARE if spec is not None and spec.method == "draft_model" else 0
        budget -= draft_budget  # the draft's pools come out of the same budget
        draft_slots = Speculation.draft_slots(c.speculative_config, block_size, max_num_seqs)
        self.manager = HybridCacheManager.from_budget(
            specs, budget, block_size, max_num_seqs, c.checkpoint_share,
            device=self.model.device, enable_prefix_caching=enable_prefix_caching,
            checkpoint_policy=c.checkpoint_policy, checkpoint_every_n=c.checkpoint_every_n,
            checkpoint_eviction=c.checkpoint_eviction, fingerprint=self.model.fingerprint,
            host_cache_bytes=c.host_cache_bytes, disk_cache_dir=c.disk_cache_dir, disk_cache_bytes=c.disk_cache_bytes,
            disk_read_ahead=c.disk_read_ahead,
            flops_per_token=2.0 * params, max_num_batched_tokens=max_num_batched_tokens,
            draft_slots=draft_slots)
        policy = PreemptionPolicy(preemption_mode, specs, block_size, self.profile, enable_prefix_caching)
        scheduler = Scheduler(self.manager, policy, max_num_batched_tokens, max_num_seqs)
        if spec is not None:  # decodes verify drafts (scheduler/speculation.py)
            drafter = None
            if draft_budget:  # the draft model, with pools of its own, runs inside the scheduler's step
                drafter = DraftModelDrafter.load(
                    spec.model, self.model.vocab_size, draft_budget, device=self.model.device, dtype=_dtype(dtype),
                    block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    draft_slots=draft_slots)
            elif with_mtp:  # the model runner computes its head's proposals each step
                drafter = MtpDrafter()
            scheduler.speculation = Speculation(spec, block_size, drafter)
        if c.verify_cache_hits > 0:  # a sampled fraction of prefix hits recomputed cold (scheduler/hit_guard.py)
            scheduler.hit_guard = HitGuard(c.verify_cache_hits, seed, self.manager.prefix_cache.invalidate,
                                           next(self.model.parameters()).dtype, (c.kv_cache_dtype, c.state_cache_dtype))
        tp = self.tensor_parallel  # its executor sends each step to ranks 1..N-1, then runs rank 0's
        self.engine = Engine(self.model, self.manager, scheduler, seed=seed, executor=tp.executor if tp else None,
                             quantize_stochastic=c.quantize_stochastic)
        if with_mtp:  # the head chains its proposals to k tokens (models/mtp_head.py)
            self.engine.runner.mtp_tokens = scheduler.speculation.next_k
        if graph_mode is not None:  # decode steps replay graphs (scheduler/decode_graphs.py)
            self.engine.runner.decode_graphs = DecodeGraphs.for_engine(self.engine, graph_mode)
        self._ids_counter = itertools.count()
        self._finished_in_generate: list[RequestOutput] = []  # add_request outputs that finished inside generate()
        s = self.engine.stats()
        log.info("%s on %s in %s: %d KV blocks of %d tokens, %d state slots (%d MiB budget), "
                 "max_num_seqs %d, max_num_batched_tokens %d", model, self.model.device,
                 self.model.dtype, s["kv_blocks_total"], block_size, s["state_slots_total"],
                 budget >> 20, max_num_seqs, max_num_batched_tokens)

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

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None) -> str:
        """Queue one prompt (text, token ids, or a vLLM prompt dict); returns its request id (a
        string: yours, refused while in use, or a free one). Bad input raises ValueError /
        TypeError; nothing else changes. A dict's own cache_salt wins over the argument. Any
        thread may call this (and abort) while another steps."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {request_id!r}")
        ids, text, salt = parse_prompt(prompt, self.tokenizer)
        rid = request_id if request_id is not None else self._new_id()
        self.engine.add_request(rid, ids, params or self.get_default_sampling_params(), text, priority,
                                salt if salt is not None else cache_salt)
        return rid

    def _new_id(self) -> str:
        rid = str(next(self._ids_counter))
        while rid in self.engine.groups:  # a caller's own id took it
            rid = str(next(self._ids_counter))
        return rid

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of requests added with add_request that advanced, plus
        those that finished while generate() was stepping."""
        finished, self._finished_in_generate = self._finished_in_generate, []
        out = self.engine.step()
        self._check_ranks()
        return finished + out

    def _check_ranks(self) -> None:
        """Raise RankFailedError when a tensor-parallel rank was lost (its requests failed)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.check()

    def close(self) -> None:
        """Finish the disk tier's queued writes; stop the tensor-parallel ranks 1..N-1."""
        self.manager.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished one's output awaits step()."""
        return bool(self._finished_in_generate) or self.engine.has_unfinished()

    def export_request(self, request_id: str) -> RequestSnapshot:
        return self.engine.export_request(request_id)

    def import_request(self, snapshot: RequestSnapshot) -> None:
        self.engine.import_request(snapshot)

    def stats(self) -> dict:
        return self.engine.stats()

    def queued(self) -> list[QueuedRequest]:
        """Every sequence the engine holds: running ones in run order, then waiting, then swapped
        (each queue in its order). What a data-parallel replica reports and migrates by."""
        sched, groups = self.engine.scheduler, self.engine.groups
        out = []
        for status, queue in (("running", sched.running), ("waiting", sched.waiting), ("swapped", sched.swapped)):
            for s in queue:
                group = groups.get(s.group_id)
                out.append(QueuedRequest(s.request_id, status, s.token_ids, s.cache_salt,
                                         s.num_prompt_tokens + s.max_tokens - len(s.token_ids),
                                         len(group.seqs) if group is not None else 1, s.finished))
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets, as vLLM: the checkpoint's
        generation_config.json sampling fields (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens) over SamplingParams' defaults. Explicit
        SamplingParams are used as given (the server fills the fields a request leaves out)."""
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        defaults = getattr(self.model, "generation_defaults", None)
        overrides = defaults.sampling_overrides() if defaults is not None else {}
        return SamplingParams(**{k: v for k, v in overrides.items() if k in names})

    def get_tokenizer(self):
        return self.tokenizer

    # ---- chat ------------------------------------------------------------------------------
    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role", "content"}, ...]) or a list of them, as
        vLLM's LLM.chat: each is formatted by the tokenizer's chat template (or `chat_template`)
        straight to token ids, so the template's BOS is the only one, then run by `generate`.
        Returns one RequestOutput per conversation. ValueError when the checkpoint has no
        tokenizer or no chat template, or the template refuses a conversation; nothing is queued."""
        one = (isinstance(messages, Sequence) and len(messages) > 0
               and isinstance(messages[0], Mapping))
        conversations = [messages] if one else list(messages)
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c, chat_template, add_generation_prompt,
                                                             continue_final_message, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, conversation: Conversation, chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """One conversation -> prompt token ids [L] through the chat template (see `chat`)."""
        return chat_prompt_ids(self.tokenizer, conversation, where=str(self.model_path),
                               instead="pass chat_template=..., or format the prompt yourself and "
                                       "pass token ids to generate()",
                               chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs)

    # ---- batch generation ------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, cache_salt: Optional[str] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run prompts (text, token-id lists or vLLM prompt dicts) to completion; outputs in prompt
        order. The whole batch is checked before any of it is queued: a refused call queues
        nothing, and a call that fails midway aborts what it queued. Its requests are its own (no
        request id of yours can reach them); a request of yours that finishes meanwhile is
        returned by your next step()."""
        if is_one_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority must be a list of ints, one per prompt; got {priority!r:.80}")
        elif len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts; give one "
                             "per prompt (or none)")
        parsed = [parse_prompt(p, self.tokenizer) for p in prompts]
        for (tok, _, _), sp, prio in zip(parsed, params, priority):  # refuse a bad batch before any is queued
            self.engine.validate(tok, sp, prio)
        keys: list = []
        try:
            for (tok, text, salt), sp, prio in zip(parsed, params, priority):
                keys.append(self.engine.add_request(self._new_id(), tok, sp, text, prio,
                                                    salt if salt is not None else cache_salt, for_generate=True))
            pending, done = set(keys), {}
            with tqdm(total=len(keys), desc="generate", disable=not use_tqdm, unit="req") as bar:
                guard = self.engine.scheduler.hit_guard  # its checks finish inside the call that made them
                while (pending or guard is not None and guard.busy) and self.engine.has_unfinished():
                    self._finished_in_generate.extend(self.engine.step(finished_only=True))
                    self._check_ranks()
                    for key in [k for k in self.engine.generate_done if k in pending]:
                        done[key] = self.engine.generate_done.pop(key)
                        pending.discard(key)
                        bar.update(1)
        except BaseException:
            for key in keys:  # leave nothing of this call queued or holding memory
                self.engine.abort(key)
                self.engine.generate_done.pop(key, None)
            raise
        return [done[k] for k in keys]


def _check_keywords(kwargs: dict) -> None:
    """Refuse a keyword LLM() does not know, naming it and the accepted ones."""
    named = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model", "kwargs")]
    extra = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in named]
    unknown = sorted(set(kwargs) - set(extra))
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}; LLM accepts: "
                        f"{', '.join(named + extra)}")
