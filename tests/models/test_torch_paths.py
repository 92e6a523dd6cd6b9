"""With native kernels off (HYBRIDKV_CPU_NATIVE=0's path: native_cpu.forced_off) the families whose
dense parts run C loops on CPU still match transformers: the torch paths of the fused residual
add + RMSNorm (plain, zero-centred, gated), rotary + KV write, Mamba2 and attention decode.
test_families.py runs the same checks with native kernels on."""
import pytest

from family_checks import FAMILIES, check_prompt_logits, check_ragged_batch_greedy
from hybridkv.kernels import native_cpu


@pytest.mark.parametrize("name", ["llama", "bamba", "qwen3_next", "granitemoehybrid"])
def test_torch_paths_match_transformers(name, family_models):
    _, ours, hf = family_models(name)
    fam = FAMILIES[name]
    with native_cpu.forced_off():
        check_prompt_logits(ours, hf, n=fam.logits_len)
        check_ragged_batch_greedy(ours, hf, lengths=fam.ragged, steps=8)
