"""kernels/ops.py: each op declared once with a CPU and a CUDA implementation of one signature, and
the models reach kernels only through it."""
import ast
import inspect
from pathlib import Path

import pytest
import torch

from hybridkv.kernels import ops

MODELS = Path(__file__).resolve().parents[2] / "models"


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(ops.OPS))
def test_both_implementations_take_the_ops_arguments(name):
    op = ops.OPS[name]
    own = _params(op)  # the call written from the op's signature (dispatch.declare)
    cpu = op.impl("torch")
    assert cpu is not None and op.__doc__.strip()
    assert _params(cpu) == own, f"{name}: {op.cpu} does not take the op's parameters {op.signature}"
    cuda = op.impl("triton")  # imports the Triton module (no kernel runs)
    if cuda is not None:
        assert _params(cuda) == own, f"{name}: {op.cuda} does not take the op's parameters {op.signature}"


def test_an_op_hands_its_arguments_on_as_given(monkeypatch):
    from hybridkv.kernels import rms_norm

    seen = []
    monkeypatch.setattr(rms_norm, "rms_norm", lambda *a: seen.append(a) or "out")
    x, w = torch.zeros(1, 4), torch.ones(4)
    assert ops.rms_norm(x, w, eps=1e-6) == "out" and ops.rms_norm(x, w, 1e-5, True) == "out"
    assert seen == [(x, w, 1e-6, False), (x, w, 1e-5, True)]  # defaults filled, keywords by position
    with pytest.raises(TypeError):
        ops.rms_norm(x, w)  # a missing argument fails at the op, as a def does


def test_backend_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_BACKEND", raising=False)
    t = torch.zeros(1)
    assert ops.write_kv.backend(t) == "torch"
    assert ops.write_kv.backend(torch.zeros(1, device="meta")) == "torch"
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    assert ops.write_kv.backend(t) == "triton"
    plans = {}
    assert ops.write_kv.backend(t, plans) == "triton" and plans == {"backend": "triton"}
    monkeypatch.setenv("HYBRIDKV_BACKEND", "torch")
    assert ops.write_kv.backend(t, plans) == "triton"  # looked up once per step


def test_an_op_without_a_kernel_for_the_backend_returns_none(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    assert ops.rope_write_kv.impl("triton") is None
    assert ops.rope_write_kv(torch.zeros(2, 12), None, 1, 1, 4, torch.zeros(1, 2, 4, 1, 4),
                             torch.zeros(2, dtype=torch.long)) is None


def test_the_package_reexports_the_same_ops():
    import hybridkv.kernels as K

    for name in K.__all__:
        assert getattr(K, name) is ops.OPS[name]


def _kernel_imports(path: Path):
    """(module, names) of every import of hybridkv.kernels in a file, function-local ones too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridkv.kernels"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "hybridkv":
            yield "hybridkv", [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hybridkv.kernels"):
                    yield a.name, []


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.py")), ids=lambda p: p.name)
def test_models_call_only_the_registry(path):
    for module, names in _kernel_imports(path):
        if module == "hybridkv":
            assert "kernels" not in names, f"{path.name}: `from hybridkv import kernels`; use kernels.ops"
        else:
            assert (module, names) == ("hybridkv.kernels", ["ops"]), \
                f"{path.name} imports {module} {names}: models call hybridkv.kernels.ops only"
