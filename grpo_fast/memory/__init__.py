"""What fits on a GPU: the memory model of one GRPO (or PPO) training step and the ``grpo-fast fit`` command.

``models``: the registry of real architectures (shapes only); ``projection``: the step's bytes by phase and component
from the parameter count and measured coefficients (``calibration.json``, shipped with the package); ``fit``: the
command. The measurements that produce the coefficients need the memory tracker of ``bench/`` (a source checkout):
``grpo-fast fit --calibrate``; ``source_module`` imports such a ``bench/`` module (for it and for ``grpo-fast bench
memory``).
"""

import importlib
import sys
from pathlib import Path


def source_module(name: str, command: str):
    """``bench.<name>`` from the source checkout next to this package (the benchmarks are not installed); ``command``
    names the ``grpo-fast`` command that needs it, for the error message."""
    root = Path(__file__).resolve().parent.parent.parent
    if not (root / "bench" / "harness.py").exists():
        raise ImportError(f"grpo-fast {command} runs from a source checkout: {root / 'bench'} is missing (pip installs "
                          "only the package); clone the repository and install it with pip install -e .")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"bench.{name}")
