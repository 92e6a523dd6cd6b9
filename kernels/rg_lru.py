"""The RG-LRU over state slots as the mixer calls it: the Triton decode step
(kernels/rg_lru_kernel.py) on CUDA, the torch reference (kernels/rg_lru_ref.py, the
specification) on CPU; HYBRIDKV_BACKEND overrides. Prefill scans run the torch reference.
"""
from __future__ import annotations

from .dispatch import backend_for
from .rg_lru_ref import rg_lru_scan_ref, rg_lru_state_update_ref


def rg_lru_state_update(state, x, input_gate, recurrent_gate, recurrent_param, slot_idx):
    """One decode token per request; state [S, W] updated in place at slot_idx [B] -> y [B, W]."""
    fn = rg_lru_state_update_ref
    if backend_for(x) == "triton":
        from .rg_lru_kernel import rg_lru_state_update_triton as fn  # Triton only where it runs
    return fn(state, x, input_gate, recurrent_gate, recurrent_param, slot_idx)


def rg_lru_scan(state, x, input_gate, recurrent_gate, recurrent_param, query_start_loc, slot_idx,
                has_initial_state, return_states_at=None):
    """Varlen scan from each slot's state (torch on every device); see rg_lru_ref.rg_lru_scan_ref."""
    return rg_lru_scan_ref(state, x, input_gate, recurrent_gate, recurrent_param, query_start_loc,
                           slot_idx, has_initial_state, return_states_at)
