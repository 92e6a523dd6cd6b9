"""Nemotron-H: one mixer per block, chosen by `hybrid_override_pattern` (`config.layers_block_type`).

"M" Mamba2, "*" attention (no positional encoding, no biases), "-" a relu2 MLP and "E" a MoE with
sigmoid, group-limited top-k routing, relu2 experts and a shared expert. Every block is
`h = h + mixer(norm(h))`; only "M" and "*" blocks keep anything between steps, so "-" and "E"
blocks have no cache spec. In prefill transformers clamps Mamba's dt from below at
`time_step_min` (its decode step does not; neither do we).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .mamba2_mixer import Mamba2Mixer
from .norms import RMSNorm
from .row_parallel import RowParallel
from .slot_split import split_decode_prefill

ARCHITECTURE = "NemotronHForCausalLM"
# transformers' block types, the legacy names and the pattern letters -> our kind
_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
          "full_attention": "attention", "attention": "attention", "*": "attention",
          "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tiny_config(**overrides):
    """A 6-layer NemotronHConfig, pattern "M-*EM*": every block kind; MoE with 8 relu2 experts in 2
    groups (top-1 group, top-2 experts), a shared expert and routed scaling; Mamba2 chunk size 8."""
    from transformers import NemotronHConfig

    kw = dict(vocab_size=128, hidden_size=64, hybrid_override_pattern="M-*EM*",
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
              mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
              chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
              layer_norm_epsilon=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return NemotronHConfig(**kw)


def layer_kinds(config) -> list[str]:
    """"mamba" / "attention" / "mlp" / "moe" for each block, from `layers_block_type`."""
    kinds = []
    for i, t in enumerate(config.layers_block_type):
        if t not in _KINDS:
            raise ValueError(f"layers_block_type[{i}] is {t!r}; Nemotron-H blocks are one of "
                             f"{sorted(_KINDS)}")
        kinds.append(_KINDS[t])
    return kinds


class NemotronRMSNorm(RMSNorm):
    """RMSNorm that multiplies the weight in float32 and casts after, as transformers' NemotronHRMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronHMLP(RowParallel, nn.Module):
    """x [T, in] -> [T, in]: down_proj(act(up_proj(x))), act relu2 by default (HF names)."""

    def __init__(self, in_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        from transformers.activations import ACT2FN

        self.up_proj = nn.Linear(in_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, in_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rank_sum(self.down_proj(self.act_fn(self.up_proj(x))))


class NemotronHRouter(nn.Module):
    """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k]).

    sigmoid scores; choice by score + e_score_correction_bias within the `topk_group` best of
    `n_group` groups (a group scores the sum of its top-2); weights are the chosen raw scores,
    renormalised when `norm_topk_prob`, times `routed_scaling_factor`. Kept in float32 whatever
    the model dtype, like transformers' `_keep_in_fp32_modules_strict`.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # routing stays float32 when the model is cast (transformers keeps it so, too)
        self.weight.data = self.weight.data.float()
        self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(hidden.float() @ self.weight.float().t())
        choice = scores + self.e_score_correction_bias
        T, per_group = choice.shape[0], self.num_experts // self.n_group
        group_scores = choice.view(T, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.bool().unsqueeze(-1).expand(T, self.n_group, per_group).reshape(T, -1)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class NemotronHExperts(nn.Module):
    """The routed relu2 experts stacked: `up_proj [E, I, H]`, `down_proj [E, H, I]` (no gate
    rows), the layout hybridkv.kernels.fused_moe reads with gated=False."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


class NemotronHMoE(RowParallel, nn.Module):
    """hidden [T, H] -> [T, H]: routed relu2 experts (optionally in a latent width) + shared expert.
    Names: gate, experts.{up,down}_proj stacked over experts (transformers' in-memory layout;
    published per-expert `experts.E.{up,down}_proj.weight` load through _NemotronNames),
    shared_experts, fc1_latent_proj / fc2_latent_proj when `moe_latent_size` is set."""

    def __init__(self, config):
        super().__init__()
        h, act, bias = config.hidden_size, config.mlp_hidden_act, config.mlp_bias
        latent = config.moe_latent_size
        self.gate = NemotronHRouter(config)
        self.experts = NemotronHExperts(config.n_routed_experts, latent or h, config.moe_intermediate_size)
        self.act = act
        self.shared_experts = NemotronHMLP(h, config.moe_shared_expert_intermediate_size, act, bias)
        self.fc1_latent_proj = nn.Linear(h, latent, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=bias) if latent else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        x = self.fc1_latent_proj(hidden) if self.fc1_latent_proj is not None else hidden
        # the routed experts as one fused op over the stacked weights (no per-expert host sync)
        out = ops.fused_moe(x, self.experts.up_proj, self.experts.down_proj, weights.to(x.dtype), ids,
                            self.act, gated=False)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return self.rank_sum(out + self.shared_experts(hidden))


class NemotronHBlock(nn.Module):
    """`norm` then `mixer`: Mamba2Mixer, PagedAttention, NemotronHMLP or NemotronHMoE (HF names)."""

    def __init__(self, config, kind: str):
        super().__init__()
        h = config.hidden_size
        self.kind = kind
        self.norm = NemotronRMSNorm(h, eps=config.layer_norm_epsilon)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(h, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                                     config.ssm_state_size, config.conv_kernel, config.chunk_size,
                                     eps=config.layer_norm_epsilon, conv_bias=config.use_conv_bias,
                                     proj_bias=config.use_bias, activation=config.mamba_hidden_act,
                                     dt_limit=(config.time_step_min, float("inf")))
        elif kind == "attention":
            self.mixer = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                        config.head_dim)
        elif kind == "mlp":
            self.mixer = NemotronHMLP(h, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias)
        else:
            self.mixer = NemotronHMoE(config)


class _NemotronHBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, kind) for kind in layer_kinds(config))
        self.norm_f = NemotronRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class _NemotronNames:
    """The checkpoint seen with this model's names (`backbone.*`, stacked `experts.up_proj`
    [E, I, H]) whether it holds transformers' in-memory ones (`model.*`, stacked) or the published
    per-expert tensors (`experts.E.{up,down}_proj.weight`)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _source(self, name: str) -> tuple[str, list[str] | None]:
        """(the stored name, None) or (the stacked name, the per-expert names to stack)."""
        for candidate in (name, "model." + name[len("backbone."):] if name.startswith("backbone.") else None):
            if candidate is None:
                continue
            if candidate in self.ckpt:
                return candidate, None
            head, sep, tail = candidate.rpartition(".experts.")
            if sep and tail in ("up_proj", "down_proj") and f"{head}.experts.0.{tail}.weight" in self.ckpt:
                per_expert, e = [], 0
                while f"{head}.experts.{e}.{tail}.weight" in self.ckpt:
                    per_expert.append(f"{head}.experts.{e}.{tail}.weight")
                    e += 1
                return candidate, per_expert
        return name, None

    def __contains__(self, name: str) -> bool:
        source, per_expert = self._source(name)
        return per_expert is not None or source in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        source, per_expert = self._source(name)
        if per_expert is None:
            return self.ckpt.get(source)  # raises the checkpoint's "missing tensor" error
        return torch.stack([self.ckpt.get(n) for n in per_expert])


class NemotronHModel(HybridModel):
    """Parameter names equal the published checkpoint's (backbone.layers.N.mixer.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.backbone = _NemotronHBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        ssm = _DTYPES.get(str(getattr(config, "mamba_ssm_cache_dtype", "") or ""))
        self._ssm_dtype = ssm  # the SSM state's dtype the checkpoint asks for (vLLM honours it too)

    def tied_weights(self) -> dict[str, str]:
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head.weight": "backbone.embeddings.weight"}
        return {}

    def load_weights(self, ckpt) -> None:
        """Published names, or transformers' `model.*` names with stacked expert tensors."""
        super().load_weights(_NemotronNames(ckpt))

    def cache_specs(self) -> dict[int, LayerSpec]:
        """Specs for the "M" and "*" blocks only; MLP and MoE blocks keep nothing."""
        dtype = self.dtype
        state_dtype = self._ssm_dtype if self._ssm_dtype not in (None, dtype) else None
        specs: dict[int, LayerSpec] = {}
        for i, block in enumerate(self.backbone.layers):
            if block.kind == "mamba":
                specs[i] = block.mixer.cache_spec(dtype, state_dtype)
            elif block.kind == "attention":
                specs[i] = block.mixer.spec(dtype)
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.backbone.embeddings(batch.input_ids)
        split = split_decode_prefill(batch)  # one decode/prefill split shared by all mixers
        for i, block in enumerate(self.backbone.layers):
            x = block.norm(h)
            if block.kind == "mamba":
                x = block.mixer(x, batch, caches.conv[i], caches.state[i], split)
            elif block.kind == "attention":
                x = block.mixer(x, None, batch, caches.kv[i])
            else:
                x = block.mixer(x)
            h = h + x
        return self.compute_logits(self.backbone.norm_f(h), batch, self.lm_head)


MODEL_CLASS = NemotronHModel
