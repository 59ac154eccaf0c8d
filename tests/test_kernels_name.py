"""The repository's ``kernels/`` folder is ``grpo_fast.kernels`` and never a top-level ``kernels``: from the checkout's
root (the root first on ``sys.path``, as ``python -m pytest`` and ``python -m grpo_fast`` put it), ``import kernels``
finds Hugging Face's package (transformers >= 5.2x imports it), played here by a stand-in; without one it is an empty
module that transformers reads as no usable ``kernels``."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
out = {}
import kernels
try:
    from kernels.utils import WHERE
    from kernels import CUDAProperties
    out["kernels"] = [kernels.__file__, CUDAProperties, WHERE]
except ImportError as e:
    out["kernels"] = [kernels.__file__, sorted(k for k in vars(kernels) if not k.startswith("__"))]
    from transformers.utils.import_utils import is_kernels_available
    import transformers.integrations.hub_kernels
    out["transformers sees kernels"] = is_kernels_available()
import grpo_fast.kernels
from grpo_fast.kernels import grpo_loss
out["grpo_fast.kernels"] = [grpo_fast.kernels.__file__, grpo_loss.__file__]
print(json.dumps(out))
"""


def _probe(tmp_path, stand_in: bool, how: str, second_checkout: bool = False) -> dict:
    env_path = []
    if second_checkout:  # another grpo-fast checkout (a worktree, say) also on the path, before the package
        other = tmp_path / "worktree" / "kernels"
        other.mkdir(parents=True)
        (other / "__init__.py").write_text((ROOT / "kernels" / "__init__.py").read_text())
        env_path.append(str(tmp_path / "worktree"))
    if stand_in:
        pkg = tmp_path / "site" / "kernels"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("CUDAProperties = 'stand-in'\n")
        (pkg / "utils.py").write_text("WHERE = __file__\n")
        env_path.append(str(tmp_path / "site"))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # -c and -m put the working directory first on sys.path; a script run from the root with PYTHONPATH=. too
    cmd = {"-c": [sys.executable, "-c", PROBE],
           "pythonpath": [sys.executable, str(script)]}[how]
    if how == "pythonpath":
        env_path.insert(0, str(ROOT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(env_path)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_kernels_from_the_root_finds_the_other_package(tmp_path):
    for how in ("-c", "pythonpath"):
        out = _probe(tmp_path / how, stand_in=True, how=how)
        site = str(tmp_path / how / "site" / "kernels")
        assert out["kernels"] == [f"{site}/__init__.py", "stand-in", f"{site}/utils.py"], how
        assert out["grpo_fast.kernels"][0] == str(ROOT / "kernels" / "__init__.py"), how
        assert out["grpo_fast.kernels"][1] == str(ROOT / "kernels" / "grpo_loss.py"), how


def _installed_kernels():
    """The ``kernels`` package installed in this environment (Hugging Face's), if any: its ``__init__.py``."""
    path = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    return None if spec is None else spec.origin


def test_import_kernels_from_the_root_without_a_stand_in(tmp_path):
    """Hugging Face's ``kernels`` where it is installed (transformers' hub-kernels integration then imports from
    it); where it is not, an empty module that transformers reads as no usable ``kernels``."""
    out = _probe(tmp_path, stand_in=False, how="-c")
    installed = _installed_kernels()
    if installed is None:
        assert out["kernels"] == [str(ROOT / "kernels" / "__init__.py"), []]
        assert out["transformers sees kernels"] is False
    else:
        assert out["kernels"][0] == installed and out["kernels"][1], out
        assert out.get("transformers sees kernels") is True, out
    assert out["grpo_fast.kernels"][0] == str(ROOT / "kernels" / "__init__.py")


def test_two_checkouts_on_the_path_hand_on_past_each_other(tmp_path):
    out = _probe(tmp_path / "with", stand_in=True, how="-c", second_checkout=True)
    assert out["kernels"][0] == str(tmp_path / "with" / "site" / "kernels" / "__init__.py")
    out = _probe(tmp_path / "without", stand_in=False, how="-c", second_checkout=True)
    if _installed_kernels() is None:
        assert out["kernels"] == [str(ROOT / "kernels" / "__init__.py"), []]
