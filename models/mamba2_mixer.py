"""Mamba2 (SSD) mixer over state slots, as in Bamba / GraniteMoeHybrid / NemotronH.

Prefill chunks go through the varlen kernels (`causal_conv1d`, `mamba2_chunk_scan`), decodes
through the one-token kernels (`conv1d_update`, `mamba2_state_update`); both read and write the
layer's pools in place through the requests' state slots. A step of decodes only runs, on CPU in
fp32, everything between in_proj and out_proj in one C call (`ops.mamba2_mixer_decode`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from .forward_batch import ForwardBatch, QuantizedState
from .norms import GatedRMSNorm
from .row_parallel import RowParallel
from .slot_split import SlotSplit, split_decode_prefill


class Mamba2Mixer(RowParallel, nn.Module):
    """in_proj -> [z | xBC | dt]; conv + silu on xBC; SSD scan; gated RMSNorm by z; out_proj.

    hidden_size: model width; num_heads H, head_dim P (H * P = d_inner); n_groups G of B/C;
    d_state N; d_conv: conv kernel k; chunk_size: SSD chunk; dt_limit: (min, max) clamp of the
    discretised dt in prefill (transformers applies none in its decode step, nor do we).
    Parameter names follow transformers' BambaMixer (in_proj, conv1d, dt_bias, A_log, D, norm,
    out_proj).
    Falcon-H1 options (defaults keep the Bamba behaviour): out_bias (out_proj bias, defaults to
    proj_bias); gated_norm=False drops `norm` and gates y * silu(z); norm_before_gate for the
    gated norm; in_multiplier scales the input of in_proj; zxbcdt_multipliers (5 floats) scale
    the z, x, B, C and dt sections of in_proj's output (Falcon-H1's mup vector).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                 d_state: int, d_conv: int, chunk_size: int, eps: float, conv_bias: bool = True,
                 proj_bias: bool = False, activation: str = "silu",
                 dt_limit: Optional[tuple[float, float]] = None, out_bias: Optional[bool] = None,
                 gated_norm: bool = True, norm_before_gate: bool = False, in_multiplier: float = 1.0,
                 zxbcdt_multipliers: Optional[Sequence[float]] = None):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2 mixer activation {activation!r}; only 'silu' is supported")
        self.num_heads, self.head_dim, self.n_groups = num_heads, head_dim, n_groups
        self.d_state, self.d_conv, self.chunk_size = d_state, d_conv, chunk_size
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * d_state
        default_limit = dt_limit is None or (dt_limit[0] == 0.0 and dt_limit[1] == float("inf"))
        self.dt_limit = None if default_limit else (float(dt_limit[0]), float(dt_limit[1]))
        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim,
                                bias=conv_bias, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.d_inner, group_size=self.d_inner // n_groups, eps=eps,
                                 norm_before_gate=norm_before_gate) if gated_norm else None
        self.out_proj = nn.Linear(self.d_inner, hidden_size,
                                  bias=proj_bias if out_bias is None else out_bias)
        self.in_multiplier = float(in_multiplier)
        if zxbcdt_multipliers is not None and len(zxbcdt_multipliers) != 5:
            raise ValueError(f"zxbcdt_multipliers has {len(zxbcdt_multipliers)} values; expected 5 "
                             f"(z, x, B, C, dt)")
        self.zxbcdt_multipliers = (None if zxbcdt_multipliers is None
                                   else [float(m) for m in zxbcdt_multipliers])
        self._mup: Optional[torch.Tensor] = None  # built lazily: the model is built on `meta`
        # ops.mamba2_mixer_decode keeps the call it builds for this layer's pools and weights here
        self._decode_cache: dict = {}

    def _mup_vector(self, like: torch.Tensor) -> torch.Tensor:
        """[d_inner + conv_dim + H] per-column multipliers of in_proj's output, on like's device/dtype."""
        if self._mup is None or self._mup.device != like.device or self._mup.dtype != like.dtype:
            GN = self.n_groups * self.d_state
            sizes = (self.d_inner, self.d_inner, GN, GN, self.num_heads)
            self._mup = torch.cat([torch.full((n,), m, dtype=torch.float32)
                                   for n, m in zip(sizes, self.zxbcdt_multipliers)]).to(like)
        return self._mup

    def cache_spec(self, dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> RecurrentSpec:
        """Per slot: conv window `[conv_dim, d_conv - 1]`, SSM state `[H, P, N]`."""
        return RecurrentSpec(conv_shape=(self.conv_dim, self.d_conv - 1),
                             state_shape=(self.num_heads, self.head_dim, self.d_state),
                             dtype=dtype, state_dtype=state_dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, split: SlotSplit | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size].

        conv_state [S, conv_dim, d_conv-1] and ssm_state [S, H, P, N] are this layer's pools,
        updated in place at `batch.state_slots`. `split` (decode vs prefill rows) may be shared
        by all recurrent layers of one step.
        """
        split = split or split_decode_prefill(batch)
        proj = self.in_proj(hidden * self.in_multiplier if self.in_multiplier != 1.0 else hidden)
        if self.zxbcdt_multipliers is not None:
            proj = proj * self._mup_vector(proj)
        if split.all_decode:  # conv, SSM step and gated norm in one C call per step, if it can run
            y = self._decode_fused(proj, conv_state, ssm_state, split.decode_slots, batch.kernel_plans)
            if y is not None:
                return self.rank_sum(self.out_proj(y.to(hidden.dtype)))
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, k]
        A = -torch.exp(self.A_log.float())
        z = proj[:, :self.d_inner]
        G, N, H, P = self.n_groups, self.d_state, self.num_heads, self.head_dim

        def ssm_inputs(rows_xbc):
            x, B, C = rows_xbc.split([self.d_inner, G * N, G * N], -1)
            n = x.shape[0]
            return x.reshape(n, H, P), B.reshape(n, G, N), C.reshape(n, G, N)

        def decode(rows, sp):
            xbc_r, dt_r = rows[:, :self.conv_dim], rows[:, self.conv_dim:]
            xbc_r = ops.conv1d_update(xbc_r, conv_state, weight, self.conv1d.bias, sp.decode_slots)
            x, B, C = ssm_inputs(xbc_r)
            y = ops.mamba2_state_update(ssm_state, x, dt_r, A, B, C, self.D, None, self.dt_bias,
                                        sp.decode_slots, dt_softplus=True)
            return y.reshape(-1, self.d_inner)

        def prefill(rows, sp):
            xbc_r, dt_r = rows[:, :self.conv_dim], rows[:, self.conv_dim:]
            xbc_r = ops.causal_conv1d(xbc_r, conv_state, weight, self.conv1d.bias,
                                      sp.prefill_qsl, sp.prefill_slots, sp.prefill_has_init)
            x, B, C = ssm_inputs(xbc_r)
            y = ops.mamba2_chunk_scan(ssm_state, x, dt_r, A, B, C, self.D, None, self.dt_bias,
                                      sp.prefill_qsl, sp.prefill_slots, sp.prefill_has_init,
                                      chunk_size=self.chunk_size, dt_softplus=True,
                                      dt_limit=self.dt_limit)
            return y.reshape(-1, self.d_inner)

        # draft runs position by position through the fused decode (the plain decode's arithmetic)
        verified = split.verify_each(proj, lambda rows, step: self._decode_fused(
            rows, conv_state, ssm_state, step.split.decode_slots, batch.kernel_plans), (conv_state, ssm_state)) \
            if split.verify else []
        y = None
        if split.has_plain_rows or not verified:  # xBC and dt are adjacent columns of proj: one view, no copy
            y = split.run(proj[:, self.d_inner:], decode, prefill, out_dim=self.d_inner, states=(conv_state, ssm_state),
                          skip_verify=bool(verified))
            y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        if verified:
            y = y if y is not None else proj.new_zeros((proj.shape[0], self.d_inner), dtype=verified[0][1].dtype)
            for rows, yv in verified:
                y[rows] = yv.to(y.dtype)
        return self.rank_sum(self.out_proj(y.to(hidden.dtype)))

    @property
    def reads_codes(self) -> bool:
        """Whether forward_codes stands for this mixer's forward (not a subclass's own)."""
        return type(self).forward is Mamba2Mixer.forward

    def forward_codes(self, hidden: torch.Tensor, batch: ForwardBatch, codes: QuantizedState) -> Optional[torch.Tensor]:
        """`forward` for a step of one-token decodes over quantized pools updated in place
        (ModelCaches.state_codes; ops.mamba2_mixer_decode_q): each slot decoded, stepped and encoded
        back in place (one C pass on the CPU, Triton kernels on CUDA), what forward computes on the
        slots decoded, encoded after. None when it cannot run here (nothing written: the caller runs
        forward on decoded slots)."""
        proj = self.in_proj(hidden * self.in_multiplier if self.in_multiplier != 1.0 else hidden)
        if self.zxbcdt_multipliers is not None:
            proj = proj * self._mup_vector(proj)
        norm = self.norm
        y = ops.mamba2_mixer_decode_q(
            proj, codes.slots, conv_pool=codes.conv, conv_layout=codes.conv_layout, ssm_pool=codes.state,
            ssm_layout=codes.state_layout, num_heads=self.num_heads, head_dim=self.head_dim, n_groups=self.n_groups,
            conv_weight=self.conv1d.weight, conv_bias=self.conv1d.bias, A_log=self.A_log, dt_bias=self.dt_bias,
            D=self.D, norm_weight=None if norm is None else norm.weight,
            norm_group=self.d_inner if norm is None else norm.group_size, eps=0.0 if norm is None else norm.eps,
            norm_mode=0 if norm is None else 2 if norm.norm_before_gate else 1, cache=self._decode_cache)
        return None if y is None else self.rank_sum(self.out_proj(y.to(hidden.dtype)))

    def _decode_fused(self, proj, conv_state, ssm_state, slots, plans):
        """The decode between in_proj and out_proj in one kernel call (ops.mamba2_mixer_decode: C on
        CPU): y [B, d_inner] fp32, or None when it cannot run here (the op-by-op path then runs)."""
        norm = self.norm
        return ops.mamba2_mixer_decode(
            proj, slots, conv_state=conv_state, ssm_state=ssm_state, num_heads=self.num_heads,
            head_dim=self.head_dim, n_groups=self.n_groups, conv_weight=self.conv1d.weight,
            conv_bias=self.conv1d.bias, A_log=self.A_log, dt_bias=self.dt_bias, D=self.D,
            norm_weight=None if norm is None else norm.weight,
            norm_group=self.d_inner if norm is None else norm.group_size, eps=0.0 if norm is None else norm.eps,
            norm_mode=0 if norm is None else 2 if norm.norm_before_gate else 1, cache=self._decode_cache,
            plan_cache=plans)
