"""README.md stays what a newcomer reads in five minutes (issue 16): at most 15,000 characters, the two set-up
commands first, exactly as .ci/run runs the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= 15_000, f"README.md is {len(text)} characters; move detail to docs/"
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("bash scripts/setup.sh && .venv/bin/grpo-fast train")
    assert block[1].startswith("bash scripts/setup.sh && .venv/bin/python -m pytest -q")
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
