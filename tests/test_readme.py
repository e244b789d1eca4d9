"""The README's usage snippet runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_snippet_runs():
    text = README.read_text()
    snippet = re.search(r"## Usage.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)
    assert "advantage" in namespace["td"].keys()


def test_ci_runs_the_readme_test_command():
    command = re.search(r"## Tests\s+```bash\n(.*?)\n```", README.read_text(), re.S).group(1).strip()
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert ci[-1].strip() == command
