"""The package list, found instead of written by hand.

pyproject's `find` names a package after its folder, so it cannot ship kernels/ as
hybridkv.kernels; here every package under each folder of pyproject's package-dir is found and
named under its mapping (kernels/x/ -> hybridkv.kernels.x). Everything else is in pyproject.toml.
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.config.pyprojecttoml import load_file

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = load_file(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-dir"]


def discover() -> list[str]:
    """Each mapped package and every package below its folder, named under the mapping."""
    found = []
    for name, folder in PACKAGE_DIR.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return found


setup(packages=discover())
