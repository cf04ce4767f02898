"""The kit's docstrings, written for Python's help() and Sphinx-style roles, as Markdown for the site.

A griffe extension (mkdocstrings loads it, ``mkdocs.yml``) and a function the site's hook uses for the run options'
texts. Two things change, nothing else:

- a role (``:class:`~flair_nbddp.RunResult```, ``:func:`.word_pieces```) becomes a link where its target is a public
  name, which the API reference documents (``[RunResult][flair_nbddp.RunResult]``), and a code span elsewhere;
- a paragraph ending in ``::`` followed by an indented block (reST's literal block) becomes the paragraph and a
  fenced Python block;
- the run options' entries, which ``flair_nbddp.options.documented`` writes under "Run options (...):", become
  Google style's "Other Parameters" section, a table like the parameters' own.

>>> public = {"flair_nbddp.result.RunResult": "flair_nbddp.RunResult"}
>>> markdown("a :class:`~flair_nbddp.result.RunResult`, or :mod:`.word_pieces`", public)
'a [RunResult][flair_nbddp.RunResult], or `word_pieces`'
>>> print(markdown("Example::\\n\\n    launch(train)\\n\\nThen.", public))
Example:
<BLANKLINE>
```python
launch(train)
```
<BLANKLINE>
Then.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+)`")
LITERAL_INTRO = re.compile(r"^(?P<indent>[ \t]*)(?P<text>.*?)::[ \t]*$")
RUN_OPTIONS = re.compile(r"^(?P<indent>[ \t]*)Run options \((?P<how>.*)\):[ \t]*$", re.M)


def public_names() -> dict[str, str]:
    """Every public name's paths (its own module's and the package's) -> where the API reference documents it."""
    import flair_nbddp

    names: dict[str, str] = {}
    for name in flair_nbddp.__all__:
        documented = f"flair_nbddp.{name}"
        names[documented] = documented
        obj = getattr(flair_nbddp, name)
        module = getattr(obj, "__module__", None)
        if module:
            names[f"{module}.{name}"] = documented
    return names


def _role(match: re.Match, public: dict[str, str]) -> str:
    short, target = match.group(1) == "~", match.group(2)
    shown = target.lstrip(".").rsplit(".", 1)[-1] if short or target.startswith(".") else target
    documented = public.get(target) or public.get(f"flair_nbddp.{target}")
    return f"[{shown}][{documented}]" if documented else f"`{shown}`"


def _literal_blocks(text: str) -> str:
    lines, out, index = text.split("\n"), [], 0
    while index < len(lines):
        intro = LITERAL_INTRO.match(lines[index])
        following = lines[index + 1 :]
        if intro is None or not following or following[0].strip():
            out.append(lines[index])
            index += 1
            continue
        indent = len(intro["indent"].expandtabs())
        block_end = index + 1
        while block_end + 1 < len(lines) and (
            not lines[block_end + 1].strip() or len(lines[block_end + 1]) - len(lines[block_end + 1].lstrip()) > indent
        ):
            block_end += 1
        block = "\n".join(lines[index + 2 : block_end + 1]).rstrip()
        if not block.strip():
            out.append(lines[index])
            index += 1
            continue
        text_before = intro["text"].rstrip()
        out.append(f"{intro['indent']}{text_before}:" if text_before else "")
        out += ["", *(f"{intro['indent']}{line}" for line in ["```python", *textwrap.dedent(block).split("\n"), "```"])]
        index = block_end + 1
        if index < len(lines) and lines[index].strip():
            out.append("")
    return "\n".join(out)


def markdown(text: str, public: dict[str, str]) -> str:
    """``text`` with its roles and literal blocks in Markdown (see the module's docstring)."""
    text = RUN_OPTIONS.sub(r"\g<indent>Run options: \g<how>.\n\n\g<indent>Other Parameters:", text)
    return ROLE.sub(lambda match: _role(match, public), _literal_blocks(text))


try:
    import griffe
except ImportError:  # imported by the site's hook, where only markdown() is used
    griffe = None

if griffe is not None:

    class DocstringRoles(griffe.Extension):
        """Rewrites every docstring mkdocstrings loads (see the module's docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self._public: dict[str, str] | None = None

        def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
            if obj.docstring is None:
                return
            if self._public is None:
                self._public = public_names()
            obj.docstring.value = markdown(obj.docstring.value, self._public)
