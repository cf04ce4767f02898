"""The documentation site is true to the code: it documents every public name, option and tutorial, and it builds.

The fast tests read the sources; the ``docs`` test builds the whole site as ``make docs`` does, in strict mode:
a broken link or anchor, a missing reference, a failing docstring example or a warning of any plugin fails it.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import flair_nbddp
from flair_nbddp.options import magic_flags, option_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names a Python function (the Mermaid fence's formatter): read it as its name."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


NAV = _nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)["nav"])


def test_the_api_reference_documents_every_public_name_and_nothing_else():
    documented = re.findall(r"^::: flair_nbddp\.(\w+)$", (DOCS / "reference" / "api.md").read_text(), re.M)
    assert sorted(documented) == sorted(flair_nbddp.__all__)
    assert len(documented) == len(set(documented)), "a name is documented twice"


def test_every_tutorial_is_in_the_nav():
    assert [page for page in NAV if page.startswith("tutorials/")] == [f"tutorials/{path.name}" for path in NOTEBOOKS]
    assert (DOCS / "tutorials").resolve() == (ROOT / "notebooks").resolve()


def test_every_page_is_in_the_nav():
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md") if path.name != "README.md"}
    generated = {"performance.md"}  # written by the build hook from benchmarks/results
    notebooks = {page for page in NAV if page.endswith(".ipynb")}
    assert set(NAV) - notebooks == pages | generated


def _hook():
    """docs/hooks/site.py, the build hook that writes the generated parts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_site_hook", DOCS / "hooks" / "site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_lists_every_option_and_flag():
    hook = _hook()
    table, magics = hook.run_options_table(), hook.magics_help()
    assert [row.split("`")[1] for row in table.splitlines()[2:]] == list(option_names())
    for flag in magic_flags():
        assert f"`{flag.name}`" in table and flag.name in magics, flag.name
    assert all(f"{name}" in magics for name in hook.MAGICS)


@pytest.mark.docs
def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-6000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    missing = [name for name in flair_nbddp.__all__ if f'id="flair_nbddp.{name}"' not in api]
    assert missing == [], f"the API reference has no entry for {missing}"
    for notebook in NOTEBOOKS:
        page = (site / "tutorials" / notebook.stem / "index.html").read_text()
        outputs = sum(len(cell.get("outputs", [])) for cell in json.loads(notebook.read_text())["cells"])
        assert outputs and page.count('class="jp-OutputArea-child') == outputs, notebook.name  # each output rendered
    performance = (site / "performance" / "index.html").read_text()
    assert "<table>" in performance


def test_the_map_of_the_package_names_every_module():
    """docs/how-it-works.md is the project's map: a module added without its row there fails here."""
    text = (DOCS / "how-it-works.md").read_text()
    package = ROOT / "flair_nbddp"
    missing = [str(path.relative_to(ROOT)) for path in sorted(package.rglob("*.py")) if f"`{path.name}`" not in text]
    assert missing == [], f"docs/how-it-works.md's map does not list {missing}"
