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


def _llm_table_rows(summary_csv: Path) -> list[str]:
    """The README's llm-compare table rows, rebuilt from the committed summary CSV."""
    import csv

    runs = list(csv.DictReader(summary_csv.open()))
    lines = []
    for estimator in dict.fromkeys(r["estimator"] for r in runs):
        mine = sorted((r for r in runs if r["estimator"] == estimator), key=lambda r: int(r["seed"]))
        solved = sum(r["tokens_to_threshold"] != "" for r in mine)
        reached = " / ".join(f"{int(r['tokens_to_threshold']) / 1000:.0f}k"
                             if r["tokens_to_threshold"] else "never" for r in mine)
        finals = " / ".join(f"{100 * float(r['final_success_rate']):.1f} %" for r in mine)
        lines.append(f"| {estimator} | {solved}/{len(mine)} | {reached} | {finals} |")
    return lines


def test_readme_llm_table_is_the_committed_comparison():
    """Every row of the README's llm-compare table is what docs/llm_compare_summary.csv says."""
    text = README.read_text()
    section = re.search(r"## Language-model agents.*?(?=\n## )", text, re.S).group(0)
    expected = _llm_table_rows(README.parent / "docs" / "llm_compare_summary.csv")
    assert len(expected) == 3
    table = [line for line in section.splitlines()
             if re.match(r"\| (masked|grpo|plain) \|", line)]
    assert table == expected
