"""The site's generated parts, made at every build so that they cannot drift from the code:

- the tutorials: the notebooks of ``notebooks/``, rendered with the outputs they were committed with;
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the notebooks it finds into pages
def on_files(files: Files, config) -> Files:
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, f"tutorials/{notebook.name}", abs_src_path=str(notebook)))
    return files
