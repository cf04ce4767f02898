"""The README tells the truth: its 30-second snippet defines every name it uses."""

import builtins
import re
from pathlib import Path

from flair_nbddp.notebook.cell_names import free_names

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_thirty_second_snippet_defines_every_name_it_uses():
    snippet = next(block for block in _python_blocks() if "launch_distributed(train, corpus)" in block)
    undefined = [name for name in free_names(snippet) if not hasattr(builtins, name)]
    assert undefined == [], f"the README's 30-second snippet uses {undefined} without defining them"
