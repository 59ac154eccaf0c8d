"""Triton kernels and their launchers, installed as ``grpo_fast.kernels`` (setuptools' package-dir maps this folder).

Never a top-level ``kernels``: where the repository root is on ``sys.path`` (``python -m pytest`` or ``python -m
grpo_fast`` from the checkout), ``import kernels`` would find this folder before Hugging Face's ``kernels`` package,
which transformers imports (``transformers.integrations.hub_kernels``). Imported under that name, this file hands the
import on to the next ``kernels`` the import system finds (a regular install or an editable one), skipping every
grpo-fast checkout's folder (this marker tells them apart: GRPO_FAST_KERNELS_FOLDER); where there is none it stays an
empty module without a version, which transformers' availability check (it imports what ``find_spec`` finds) reads as
no usable ``kernels``.
"""

if __name__ == "kernels":

    def _hand_on() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        def is_a_checkout(origin) -> bool:
            try:
                with open(origin, encoding="utf-8") as f:
                    return "GRPO_FAST_KERNELS_FOLDER" in f.read(4096)
            except (OSError, TypeError, ValueError):
                return False

        def find(path):
            for finder in sys.meta_path:
                if finder is importlib.machinery.PathFinder:
                    spec = finder.find_spec("kernels", path)
                elif hasattr(finder, "find_spec"):
                    spec = finder.find_spec("kernels", None)
                else:
                    continue
                if spec is not None:
                    return spec
            return None

        path, seen = list(sys.path), set()
        while True:
            spec = find(path)
            if spec is None or not is_a_checkout(spec.origin):
                break
            if spec.origin in seen:  # a finder that does not search sys.path found a checkout again
                spec = None
                break
            seen.add(spec.origin)
            root = os.path.realpath(os.path.dirname(os.path.dirname(spec.origin)))
            path = [p for p in path if os.path.realpath(p or os.getcwd()) != root]
        if spec is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # what the import statement returns (a module may replace itself)
        spec.loader.exec_module(module)

    _hand_on()
    del _hand_on
