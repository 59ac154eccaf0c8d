"""README.md stays what a newcomer reads in five minutes: at most 15,000 characters, the two set-up commands first,
exactly as .ci/run runs the second. And the Python the README and docs/ show runs as shown.

Runnable blocks: a ```python block right after the line ``<!-- runnable -->`` (invisible on GitHub). A file's
runnable blocks run in order as one script (a later block sees an earlier one's names), in a fresh interpreter whose
working directory holds ``runs/grpo-fast/model``: the built-in tiny model saved as ``grpo-fast train`` saves it, the
directory the docs load. ``<!-- runnable after the set-up of docs/recipes.md -->`` runs that file's first runnable
block (its set-up: a tiny Qwen2 and a batch) before the file's own, for a block that shows a step and not its
stand-ins. Nothing is downloaded: the models are built from configs. Unmarked blocks are fragments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?: after the set-up of (?P<setup>\S+))? -->\n```python\n(?P<code>.*?)^```$",
                    re.S | re.M)
# what each document's blocks must have left behind (beyond running): the values they claim
CHECKS = {
    "README.md": "assert out.loss.isfinite() and policy.lm_head.weight.grad is not None and GRPOTrainer.__name__ == "
                 "'FastGRPOTrainer'",
    "docs/train.md": "assert tokenizer.batch_decode(out)[0].startswith('max 3 8 1 6='), tokenizer.batch_decode(out)",
    "docs/recipes.md": "assert out.loss.isfinite() and all(p.grad is None for p in policy.parameters())",
}


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= 15_000, f"README.md is {len(text)} characters; move detail to docs/"
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("bash scripts/setup.sh && .venv/bin/grpo-fast train")
    assert block[1].startswith("bash scripts/setup.sh && .venv/bin/python -m pytest -q")
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def runnable_blocks(name: str) -> list[re.Match]:
    return list(MARKER.finditer((ROOT / name).read_text(encoding="utf-8")))


def documents() -> list[str]:
    return [name for name in ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
            if runnable_blocks(name)]


def test_the_marked_blocks_are_the_ones_that_claim_to_run():
    """The README's headline drop-in is marked, every block of docs/recipes.md ("every block below runs as it is")
    is, and every document with marked blocks has its check."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = readme.split("## Replace your trainer's loss in three lines", 1)[1].split("\n## ", 1)[0]
    assert MARKER.search(headline) and "grpo_loss(" in MARKER.search(headline)["code"]
    recipes = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert len(runnable_blocks("docs/recipes.md")) == recipes.count("```python\n") >= 5
    assert set(documents()) == set(CHECKS)


def _script(name: str) -> str:
    parts = []
    for match in runnable_blocks(name):
        if match["setup"]:
            parts.append(f"# the set-up of {match['setup']}\n" + runnable_blocks(match["setup"])[0]["code"])
        parts.append(f"# {name}, the block at character {match.start()}\n" + match["code"])
    return "\n".join(parts + [CHECKS[name], "print('ran', flush=True)"])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory with ``runs/grpo-fast/model``, as the default run leaves it."""
    from grpo_fast.train.export import save_model
    from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

    where = tmp_path_factory.mktemp("docs")
    tokenizer = tiny_tokenizer()
    save_model(tiny_model(tokenizer, seed=0), tokenizer, where / "runs" / "grpo-fast" / "model", max_new_tokens=4)
    return where


@pytest.mark.parametrize("name", documents())
def test_the_runnable_blocks_run(name, workdir):
    script = _script(name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ran"), f"{name}:\n{script}\n{proc.stderr[-3000:]}"
