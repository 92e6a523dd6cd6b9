"""The namespace mapping: every part imports as hybridkv.* from any working directory."""
import subprocess
import sys


def test_namespace_imports_from_another_directory(tmp_path):
    code = (
        "import hybridkv, hybridkv.kernels, hybridkv.models, hybridkv.scheduler, pathlib;"
        "print(pathlib.Path(hybridkv.kernels.__file__).parent.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "kernels"
