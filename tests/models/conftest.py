"""The tiny checkpoint and both models of each family row, built and loaded once per session and
shared by test_families.py and the per-family files."""
import pytest

from family_checks import FAMILIES, load_family


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """name -> (checkpoint dir, our model, transformers' float32 model) of FAMILIES[name]."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_family(FAMILIES[name], tmp_path_factory.mktemp(name))
        return loaded[name]

    return get
