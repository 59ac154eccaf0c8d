"""Triton kernels and their launchers, installed as ``grpo_fast.kernels`` (setuptools' package-dir maps this folder).

Never a top-level ``kernels``: where the repository root is on ``sys.path`` (``python -m pytest`` or ``python -m
grpo_fast`` from the checkout), ``import kernels`` would find this folder before Hugging Face's ``kernels`` package,
which transformers imports (``transformers.integrations.hub_kernels``). Imported under that name, this file hands the
import on to the next ``kernels`` on the path; where there is none it stays an empty module without a version, which
transformers' availability check (it imports what ``find_spec`` finds) reads as no usable ``kernels``.
"""

if __name__ == "kernels":

    def _hand_on() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        here = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
        path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # what the import statement returns (a module may replace itself)
        spec.loader.exec_module(module)

    _hand_on()
    del _hand_on
