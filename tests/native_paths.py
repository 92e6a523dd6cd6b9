"""The two paths of a CPU kernel with a C version: a test taking the fixture that
`native_or_torch(libraries)` makes runs once with the C kernels on (each library named must build:
these machines have a C compiler) and once with them forced off (`native_cpu.forced_off()`, the
path HYBRIDKV_CPU_NATIVE=0 gives)."""
from __future__ import annotations

import pytest

from hybridkv.kernels import native_cpu


def native_or_torch(*libraries: str):
    """A pytest fixture yielding "native" then "torch"; see the module docstring."""

    @pytest.fixture(params=["native", "torch"])
    def path(request):
        if request.param == "torch":
            with native_cpu.forced_off():
                yield "torch"
            return
        for lib in libraries:
            if native_cpu.library(lib) is None:
                pytest.fail(f"these machines have a C compiler; kernels/native/{lib}.c must build here")
        yield "native"

    return path
