"""The two paths of the CPU prefill kernels (Mamba2 chunk scan, causal conv): the C kernels of
kernels/mamba2_prefill_native.py and the torch code they replace. A test that takes the
`prefill_path` fixture runs once on each and fails if the path it names did not run."""
from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import mamba2_prefill_native, native_cpu


@pytest.fixture(params=["native", "torch"])
def prefill_path(request, monkeypatch):
    """Yields "native" (C kernels on, and every call must go through them) or "torch"
    (`native_cpu.forced_off()`: none may run)."""
    calls = []
    for name in ("ssd_inputs", "ssd_scores", "ssd_chain", "ssd_output", "causal_conv"):
        fn = getattr(mamba2_prefill_native, name)
        monkeypatch.setattr(mamba2_prefill_native, name,
                            lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    if request.param == "torch":
        with native_cpu.forced_off():
            yield "torch"
        assert not calls, f"the C kernels ran although native kernels were off: {calls}"
    else:
        if not mamba2_prefill_native.usable(torch.zeros(1)):
            pytest.fail("these machines have a C compiler; the prefill C kernels must build here")
        yield "native"
        assert calls, "the test never reached the C kernels"
