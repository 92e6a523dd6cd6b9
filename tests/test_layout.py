"""The namespace mapping: every part imports as hybridkv.* from any working directory; the test
tiers: a registered `slow` marker."""
import subprocess
import sys

import pytest


@pytest.mark.slow  # a subprocess
def test_namespace_imports_from_another_directory(tmp_path):
    code = (
        "import hybridkv, hybridkv.kernels, hybridkv.models, hybridkv.scheduler, pathlib;"
        "print(pathlib.Path(hybridkv.kernels.__file__).parent.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "kernels"


def test_slow_marker_is_registered_and_strict(pytestconfig):
    """The fast tier (-m "not slow") relies on the `slow` marker: registered, and any unregistered
    marker (a typo such as @pytest.mark.slwo, which would quietly land in the fast tier) is an error."""
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert "slow" in registered
    assert pytestconfig.getoption("strict_markers")
