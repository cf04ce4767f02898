"""The README tells the truth: its snippet runs as written, and it lists every option and public name."""

import builtins
import re
from pathlib import Path

import flair_nbddp
from flair_nbddp.notebook.cell_names import free_names
from flair_nbddp.notebook.magic import DdpMagics

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_thirty_second_snippet_defines_every_name_it_uses():
    snippet = next(block for block in _python_blocks() if "launch_distributed(train, corpus)" in block)
    undefined = [name for name in free_names(snippet) if not hasattr(builtins, name)]
    assert undefined == [], f"the README's 30-second snippet uses {undefined} without defining them"


def test_every_option_of_the_magic_is_in_the_readme():
    options = re.findall(r"(--[a-z-]+)", DdpMagics.ddp_train.__doc__)
    assert len(options) >= 9
    missing = [option for option in dict.fromkeys(options) if f"`{option}" not in README]
    assert missing == [], f"the README does not mention {missing}"


def test_every_public_name_is_in_the_readme():
    missing = [name for name in flair_nbddp.__all__ if f"`{name}" not in README]
    assert missing == [], f"the README's API does not list {missing}"
