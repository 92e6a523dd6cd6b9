"""Compile the engine's Triton launches for an H100/H200 (sm_90) on a machine without a GPU.

A fake Triton driver reports GPUTarget("cuda", 90, 32); while it is active every `kernel[grid](...)`
made by a launcher compiles through Triton's own pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin
with the bundled ptxas) and returns without launching. Each compiled kernel is then measured against
sm_90's limits: shared memory per block (227 KB usable of 228 KB) and register spills, read from
`ptxas -v` on the kernel's PTX (the spill counts Triton itself only learns when loading the cubin).

Run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled):

    python -m hybridkv.kernels.sm90_compile                          # the default subset
    python -m hybridkv.kernels.sm90_compile --level full --jobs 16   # every variant
(levels: kernels/variants.py) prints one JSON object per compiled kernel, then a summary line;
exits 1 if any variant fails.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SM90_SHARED_LIMIT = 227 * 1024  # bytes a block may use on sm_90 (opt-in max; 228 KB minus 1 KB)
SM90_MAX_REGISTERS = 255


@dataclasses.dataclass
class CompiledVariant:
    """One Triton kernel compiled for one variant's launch (a launcher may launch several)."""
    variant: str
    kernel: str
    dtype: str
    num_warps: int = 0
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads reported by ptxas
    seconds: float = 0.0
    error: str | None = None

    def problems(self, spills_matter: bool) -> list[str]:
        """What breaks sm_90's limits, in words; empty when the kernel fits."""
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
        if self.shared_bytes > SM90_SHARED_LIMIT:
            out.append(f"shared memory {self.shared_bytes} B > sm_90 limit {SM90_SHARED_LIMIT} B")
        if spills_matter and self.spill_bytes:
            out.append(f"{self.spill_bytes} B of register spills ({self.registers} registers)")
        return out


class _Sm90Driver:
    """Just enough of a Triton driver to compile for sm_90: no device, no launches."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda


@contextlib.contextmanager
def compile_only_for_sm90():
    """Inside: Triton launches compile for sm_90 and return the kernel unlaunched; yields the list
    of CompiledKernel objects compiled so far (cached ones included)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: interpreted kernels cannot be compiled; "
                           "run the sm_90 compile in a process without it")
    compiled = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    previous = driver._active  # None on a machine without a GPU: reset_active() would fail there
    driver.set_active(_Sm90Driver())
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        driver._active = previous


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) that ptxas -v reports for sm_90a on this PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(tmp, "k.o")], capture_output=True, text=True,
                             check=True).stderr
    regs = max((int(m) for m in re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(int(a) + int(b) for a, b in
                 re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))
    return regs, spills


def compile_variant(variant) -> list[CompiledVariant]:
    """Compile every kernel `variant.launch` makes for sm_90 and measure each against the limits."""
    import torch

    t0 = time.perf_counter()
    dtype = str(variant.dtype).replace("torch.", "")
    try:
        with compile_only_for_sm90() as kernels:
            variant.launch(torch.device("cpu"))
    except Exception as e:  # reported per variant: one bad variant must not hide the others
        return [CompiledVariant(variant.name, variant.op, dtype, error=f"{type(e).__name__}: {e}",
                                seconds=time.perf_counter() - t0)]
    if not kernels:
        return [CompiledVariant(variant.name, variant.op, dtype,
                                error="the launcher compiled no Triton kernel")]
    rows = []
    for k in kernels:
        regs, spills = ptxas_usage(k.asm["ptx"])
        rows.append(CompiledVariant(variant.name, k.name, dtype, k.metadata.num_warps,
                                    k.metadata.shared, regs, spills))
    rows[-1].seconds = time.perf_counter() - t0
    return rows


def _compile_named(level_and_name):
    from . import variants

    level, name = level_and_name
    variant = next(v for v in variants.engine_variants(level) if v.name == name)
    return [(dataclasses.asdict(row), row.problems(variant.spills_matter))
            for row in compile_variant(variant)]


def main(argv=None) -> int:
    from . import variants

    ap = argparse.ArgumentParser(description="compile the engine's Triton variants for sm_90")
    ap.add_argument("--level", default="default", choices=variants.LEVELS)
    ap.add_argument("--match", default="", help="only variants whose name contains this")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = ap.parse_args(argv)
    names = [(args.level, v.name) for v in variants.engine_variants(args.level)
             if args.match in v.name]
    failed = 0
    t0 = time.perf_counter()
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            results = pool.map(_compile_named, names, chunksize=4)
    else:
        results = map(_compile_named, names)
    for rows in results:
        for row, problems in rows:
            failed += bool(problems)
            print(json.dumps({**row, "problems": problems}), flush=True)
    print(json.dumps({"summary": {"level": args.level, "variants": len(names), "failed": failed,
                                  "missing": variants.missing_entries(),
                                  "seconds": round(time.perf_counter() - t0, 1)}}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
