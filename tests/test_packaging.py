"""What a user installing the kit reads about it: licence, version, dependencies, classifiers, links."""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import flair_nbddp

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TESTED_TORCH_FLOOR = "2.2"  # README, "Platforms and versions": the lowest torch the test suite was run with


def _dependency(name: str) -> Requirement:
    return next(Requirement(spec) for spec in PROJECT["dependencies"] if Requirement(spec).name == name)


def test_the_licence_is_mit_as_an_spdx_string_with_its_file():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
    assert not any(classifier.startswith("License ::") for classifier in PROJECT["classifiers"])  # PEP 639: one place


def test_the_version_is_written_once_and_the_installed_metadata_agrees():
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", flair_nbddp.__version__)
    assert importlib.metadata.version("flair_nbddp") == flair_nbddp.__version__, "reinstall: pip install -e ."


def test_flair_is_bounded_to_the_minor_release_the_kit_bends_and_torch_to_what_was_tested():
    assert str(_dependency("flair").specifier) == "<0.16,>=0.15.1"
    assert str(_dependency("torch").specifier) == f">={TESTED_TORCH_FLOOR}"
    readme = (ROOT / "README.md").read_text()
    assert f"torch ≥ {TESTED_TORCH_FLOOR}" in readme


def test_classifiers_and_links_are_real():
    classifiers = PROJECT["classifiers"]
    assert "Operating System :: POSIX :: Linux" in classifiers and "Framework :: Jupyter :: JupyterLab" in classifiers
    urls = PROJECT["urls"]
    assert urls and all(url.startswith("https://") for url in urls.values())
    for text in [*urls.values(), (ROOT / "README.md").read_text()]:
        assert "OWNER" not in text, "a placeholder link"
