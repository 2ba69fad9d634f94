"""The README's Python snippets run as written (so the README stays true)."""

import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(BLOCKS) >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index):
    code = textwrap.dedent(BLOCKS[index])  # (a block inside a list item is indented)
    exec(compile(code, f"README.md[python block {index}]", "exec"), {})
