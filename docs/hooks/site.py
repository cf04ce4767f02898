"""The site's generated parts, made at every build so that they cannot drift from the code:

- every docstring example of the package runs first (a failing one fails the build, as ``make test-fast`` fails);
- the performance page and its plots: ``benchmarks/report.py`` renders them from ``benchmarks/results/``;
- the run options' table and the magics' help, on ``reference/options.md``: written from :class:`RunOptions` and
  the magics' own ``--help``.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PERFORMANCE_PAGE = "performance.md"
MAGICS = ("ddp_train", "ddp_sweep", "ddp_exec", "ddp_pool", "ddp_info", "ddp_runs")

sys.path.insert(0, str(HOOKS))
from docstring_roles import markdown, public_names  # noqa: E402 - a sibling file, found once HOOKS is on the path


def on_pre_build(config) -> None:
    """Run every docstring example of the package; a failure fails the build, naming the example."""
    import flair  # noqa: F401 - its logger's handler binds sys.stdout when first imported: not an example's capture
    import flair_nbddp

    failed: list[str] = []
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
    for module_info in pkgutil.walk_packages(flair_nbddp.__path__, "flair_nbddp."):
        if module_info.name.endswith("__main__"):
            continue
        module = importlib.import_module(module_info.name)
        for test in finder.find(module, module.__name__):
            result = runner.run(test, out=lambda text: failed.append(text))
            if result.failed and not failed:
                failed.append(test.name)
    if failed:
        raise PluginError("a docstring example fails:\n" + "".join(failed))


def _performance_page() -> tuple[str, dict[str, bytes]]:
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report.performance_page(RESULTS)


def on_files(files: Files, config) -> Files:
    page, images = _performance_page()
    files.append(File.generated(config, PERFORMANCE_PAGE, content=page))
    for path, content in images.items():
        files.append(File.generated(config, path, content=content))
    return files


def _default(value) -> str:
    return "`None`" if value is None else f"`{value!r}`"


def run_options_table() -> str:
    """Every run option: its name, default, magic flag and what it does."""
    from dataclasses import MISSING, fields

    from flair_nbddp.options import RunOptions, magic_flags

    flags = {flag.option: flag.name for flag in magic_flags()}
    public = public_names()
    rows = ["| option | default | magic flag | what it does |", "|---|---|---|---|"]
    for option in fields(RunOptions):
        default = option.default if option.default is not MISSING else option.default_factory()
        doc = markdown(" ".join(option.metadata["doc"].split()), public).replace("|", "\\|")
        flag = f"`{flags[option.name]}`" if option.name in flags else "(functions only)"
        rows.append(f"| `{option.name}` | {_default(default)} | {flag} | {doc} |")
    return "\n".join(rows)


def magics_help() -> str:
    """Each magic's ``--help``, as IPython prints it for ``%%ddp_train?``."""
    from flair_nbddp.notebook.magic import DdpMagics

    sections = []
    for name in MAGICS:
        doc = getattr(DdpMagics, name).__doc__
        prefix = "%%" if name in ("ddp_train", "ddp_sweep", "ddp_exec") else "%"
        sections.append(f"### `{prefix}{name}`\n\n```text\n{doc.strip()}\n```")
    return "\n\n".join(sections)


GENERATED = {"<!-- run options -->": run_options_table, "<!-- magics -->": magics_help}


def on_page_markdown(text: str, page, config, files) -> str:
    for marker, make in GENERATED.items():
        if marker in text:
            text = text.replace(marker, make())
    return text
