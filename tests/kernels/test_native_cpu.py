"""kernels/native_cpu.py: compile at first use, cache by content, fall back to torch when it cannot."""
import ctypes
import logging

import pytest
import torch

from hybridkv.kernels import native_cpu

SCALE_SRC = r"""
#include <stdint.h>
void scale_rows(float *x, int64_t rows, int64_t cols, int64_t row_stride, const float *factor) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * row_stride + c] *= factor[r];
}
"""


@pytest.fixture
def scale_lib(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native_cpu, "_loaded", {})
    src = tmp_path / "src"
    src.mkdir()
    (src / "scale.c").write_text(SCALE_SRC)
    return src


def test_builds_once_and_computes_like_torch(scale_lib, tmp_path):
    lib = native_cpu.library("scale", scale_lib)
    if native_cpu._compiler() is None:
        pytest.fail("these machines have a C compiler; the native kernels must build here")
    assert lib is not None
    x = torch.randn(5, 12)[:, :7]  # strided rows: the row stride is 12
    factor = torch.rand(5) + 0.5
    want = x * factor[:, None]
    fn = lib.scale_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn(x.data_ptr(), 5, 7, x.stride(0), factor.data_ptr())
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    built = sorted((tmp_path / "cache" / "native").glob("scale-*.so"))
    assert len(built) == 1
    assert native_cpu.library("scale", scale_lib) is lib  # once per process
    native_cpu._loaded.clear()
    assert native_cpu.library("scale", scale_lib) is not None  # a new process: loads, does not rebuild
    assert sorted((tmp_path / "cache" / "native").glob("scale-*.so")) == built
    (scale_lib / "scale.c").write_text(SCALE_SRC + "\n/* edited */\n")
    native_cpu._loaded.clear()
    native_cpu.library("scale", scale_lib)
    assert len(list((tmp_path / "cache" / "native").glob("scale-*.so"))) == 2  # edited source: rebuilt


def test_extra_code_is_compiled_with_the_file_and_hashed(scale_lib, tmp_path):
    """native_args' entry points: extra C code in the kernel file's unit (it sees its functions); a
    library per distinct extra, none left behind but the libraries."""
    extra = "int64_t scale_twice(void) { return 2; }\n"
    lib = native_cpu.library("scale", scale_lib, extra=extra)
    assert lib is not None and lib.scale_twice() == 2 and hasattr(lib, "scale_rows")
    assert native_cpu.library("scale", scale_lib, extra=extra) is lib
    assert native_cpu.library("scale", scale_lib) is not lib  # without it: another library
    other = native_cpu.library("scale", scale_lib, extra="int64_t scale_thrice(void) { return 3; }\n")
    assert other.scale_thrice() == 3 and not hasattr(other, "scale_twice")
    left = sorted(p.name for p in (tmp_path / "cache" / "native").iterdir())
    assert len(left) == 3 and all(n.endswith(".so") and ".tmp" not in n for n in left)


def test_forced_off_gives_none(scale_lib):
    with native_cpu.forced_off():
        assert not native_cpu.enabled()
        assert native_cpu.library("scale", scale_lib) is None
    assert native_cpu.enabled() == (__import__("os").environ.get(native_cpu.ENV_VAR, "1") != "0")


def test_no_compiler_warns_and_gives_none(scale_lib, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=native_cpu.__name__):
        assert native_cpu.library("scale", scale_lib) is None
    assert "no C compiler" in caplog.text and "/nonexistent/cc" in caplog.text


def test_compile_error_warns_and_gives_none(scale_lib, caplog):
    (scale_lib / "broken.c").write_text("this is not C;")
    with caplog.at_level(logging.WARNING, logger=native_cpu.__name__):
        assert native_cpu.library("broken", scale_lib) is None
    assert "broken" in caplog.text and "failed" in caplog.text
    assert not list((scale_lib.parent / "cache" / "native").glob("*.tmp.so"))  # no half-built file left


def test_headers_of_the_folder_are_included_and_hashed(scale_lib, tmp_path):
    (scale_lib / "twice.h").write_text("static inline float twice(float v) { return 2.0f * v; }\n")
    (scale_lib / "doubler.c").write_text('#include <stdint.h>\n#include "twice.h"\n'
                                         "void double_all(float *x, int64_t n) { for (int64_t i = 0; i < n; i++) "
                                         "x[i] = twice(x[i]); }\n")
    lib = native_cpu.library("doubler", scale_lib)
    assert lib is not None
    x = torch.randn(9)
    want = 2 * x
    lib.double_all.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.double_all(x.data_ptr(), 9)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    (scale_lib / "twice.h").write_text("static inline float twice(float v) { return v + v; }\n")
    native_cpu._loaded.clear()
    native_cpu.library("doubler", scale_lib)
    assert len(list((tmp_path / "cache" / "native").glob("doubler-*.so"))) == 2  # edited header: rebuilt


def test_unwritable_cache_warns_and_gives_none(scale_lib, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger=native_cpu.__name__):
        assert native_cpu.library("scale", scale_lib) is None
    assert "HYBRIDKV_CACHE_DIR" in caplog.text and "not_a_dir" in caplog.text
