"""Every Triton kernel variant the engine launches (kernels/variants.py) compiles for sm_90 with
Triton's own compiler and fits the card: no compile error, shared memory within 227 KB per block,
no register spills in the fp16 / bf16 paths. No GPU needed (kernels/sm90_compile.py).

The default run compiles the "default" level (every kernel, every dtype, the largest tiles);
HYBRIDKV_SM90_LEVEL=cover or =full compiles more (HYBRIDKV_SM90_JOBS processes, default 1).
Compiling runs in a child process: this one has TRITON_INTERPRET set, and interpreted kernels
cannot be compiled.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hybridkv.kernels import variants
from hybridkv.kernels.sm90_compile import SM90_SHARED_LIMIT, CompiledVariant

pytestmark = pytest.mark.slow  # sm_90 compiles, in a child process

LEVEL = os.environ.get("HYBRIDKV_SM90_LEVEL", "default")


def _child_env():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYBRIDKV_BACKEND")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; 1 is what runs on GPUs
    return env


def _run(args, timeout):
    out = subprocess.run([sys.executable, *args], env=_child_env(), capture_output=True, text=True,
                         timeout=timeout)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return out, rows


@pytest.fixture(scope="module")
def compiled():
    jobs = os.environ.get("HYBRIDKV_SM90_JOBS", "1")
    out, rows = _run(["-m", "hybridkv.kernels.sm90_compile", "--level", LEVEL, "--jobs", jobs],
                     timeout=None if LEVEL != "default" else 900)
    assert rows and "summary" in rows[-1], out.stdout[-2000:] + out.stderr[-4000:]
    return out, rows[:-1], rows[-1]["summary"]


def test_every_variant_fits_sm90(compiled):
    out, rows, summary = compiled
    bad = [f"{r['variant']} {r['kernel']}: {'; '.join(r['problems'])}" for r in rows
           if r["problems"]]
    assert not bad, "\n".join(bad)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["variants"] == len(variants.engine_variants(LEVEL))


def test_every_entry_and_dtype_is_compiled(compiled):
    _, rows, summary = compiled
    assert summary["missing"] == [], "entries in kernels/variants.py without their launcher"
    seen = {(r["variant"].split("[")[0], r["dtype"]) for r in rows}
    for e in variants.ENGINE_KERNELS:
        for dtype in e.default_dtypes or e.dtypes:
            assert (e.op, str(dtype).replace("torch.", "")) in seen
    assert all(r["shared_bytes"] >= 0 and r["num_warps"] > 0 for r in rows)


def test_variant_names_are_unique_and_levels_nest():
    names = {lvl: [v.name for v in variants.engine_variants(lvl)] for lvl in ("default", "cover")}
    for lvl, got in names.items():
        assert len(got) == len(set(got)), lvl
    assert set(names["default"]) <= set(names["cover"])
    with pytest.raises(ValueError, match="'everything' is not one of"):
        variants.engine_variants("everything")


# A kernel built to break both limits: a 256 x 512 and a 512 x 256 fp16 tile in shared memory
# (512 KB) and a 256 x 256 fp32 result over 4 warps (512 values a thread: spills). The check
# must see both, or it could never fail.
_BROKEN = textwrap.dedent('''
    import json, torch, triton, triton.language as tl
    from hybridkv.kernels.sm90_compile import compile_only_for_sm90, ptxas_usage

    @triton.jit
    def too_big(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))

    a = torch.randn(256, 512, dtype=torch.float16)
    b = torch.randn(512, 256, dtype=torch.float16)
    with compile_only_for_sm90() as ks:
        too_big[(1,)](a, b, torch.empty(256, 256, dtype=torch.float16), 256, 256, 512,
                      num_warps=4, num_stages=1)
    regs, spill = ptxas_usage(ks[0].asm["ptx"])
    print(json.dumps({"kernel": ks[0].name, "shared": ks[0].metadata.shared, "regs": regs,
                      "spill": spill}))
''')


def test_check_catches_shared_overflow_and_spills(tmp_path):
    script = tmp_path / "broken_kernels.py"
    script.write_text(_BROKEN)
    out, rows = _run([str(script)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    row = CompiledVariant("v", got["kernel"], "float16", 4, got["shared"], got["regs"],
                          got["spill"])
    assert row.shared_bytes > SM90_SHARED_LIMIT and row.spill_bytes > 0, got
    problems = row.problems(spills_matter=True)
    assert any("shared memory" in p for p in problems) and any("spills" in p for p in problems)
    assert not any("spills" in p for p in row.problems(spills_matter=False))
