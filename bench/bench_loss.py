"""GRPO loss forward + backward from hidden states: grpo-fast vs the materialised-logits reference vs Liger-Kernel.

For every shape (N tokens, hidden size H, vocabulary V) and every implementation this measures one training step of
the loss head: ``loss = grpo_loss(hidden, weight, ...)``, ``loss.backward()`` (gradients for hidden and the lm_head
weight), with DAPO, beta = 0.04 against given reference log-probs, epsilon = 0.2, temperature 1.0, one update per
generation (``old_logps`` = None, as TRL with ``num_iterations=1``).

Implementations (``--impls``):
  torch      grpo-fast ``impl="torch"``: vocab-chunked online logsumexp, recomputing backward, no N x V tensor
  reference  grpo-fast ``impl="reference"``: materialised ``[B, T, V]`` logits, i.e. what trainers do today
  liger      Liger-Kernel ``LigerFusedLinearGRPOLoss`` (same loss config; ``compiled=False`` on CPU)
  triton     grpo-fast ``impl="triton"`` (CUDA only)
  liger_triton  Liger-Kernel's Triton ``triton_grpo_loss`` on materialised logits (the lm_head matmul is timed too)
  matmul     the floor: the three bare lm_head matmuls of a step (logits, d hidden, d weight), no loss at all

Per shape, one fresh process first checks correctness: each implementation's loss against a float64 oracle (the
reference run in float64, row block by row block), with the tolerance rule of ``grpo_fast.testing``
(``err <= 2 * err(reference at the same dtype) + atol``). The run stops if grpo-fast's torch path breaks the rule;
other implementations' errors are recorded. Then each (implementation, shape) is timed in its own fresh process, so
its peak memory is its own and an out-of-memory failure becomes a CSV row with an ``error``.

Memory: ``peak_extra_mib`` = peak memory during warm-up and timed steps minus memory once the inputs (hidden,
weight, targets, mask, advantages, reference log-probs) exist (CPU: peak RSS, CUDA: allocator). It includes the
gradients the step must return; ``grads_mib`` is their size and ``overhead_mib = peak_extra_mib - grads_mib`` the
working memory (docs/design.md §7 bounds that at 64 MiB for grpo-fast). ``tflops`` counts 6 N H V FLOPs (the three lm_head
matmuls of forward + backward) per step.

The CSV (default ``bench/results/loss_<device>.csv``) is overwritten by each run and written again after every row,
so a run stopped by a timeout keeps the rows it finished; ``python -m bench.plot CSV`` draws it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_loss.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.models import MODELS, get_model
from grpo_fast.dtypes import SHORT_DTYPES
from grpo_fast.testing import loss_inputs

BENCHMARK = "grpo_loss_fwd_bwd"
ALL_IMPLS = ("torch", "reference", "liger", "triton", "liger_triton", "matmul")
NO_LOSS_IMPLS = ("matmul",)  # timing floors, not losses: left out of the correctness check
# The loss every implementation computes (GRPOLossConfig fields; mapped onto Liger's arguments in _liger_step).
LOSS = dict(loss_type="dapo", beta=0.04, epsilon=0.2, temperature=1.0)
REF_ROWS_FP64 = 256  # row block of the float64 oracle: a [256, V] fp64 tile is 311 MB at V = 151936


# --------------------------------------------------------------------------------------------------------------------
# Inputs and one step per implementation (these run inside the isolated child processes)


def make_inputs(batch: int, seq: int, hidden_size: int, vocab: int, dtype: str, device: str, seed: int,
                min_completion_frac: float) -> dict:
    """Seeded inputs (``grpo_fast.testing.loss_inputs``), identical in every process on the same device type:
    hidden and weight in ``dtype`` (a short name, ``bf16``) requiring grad, completion lengths uniform in
    ``[ceil(F * T), T]`` (an int64 mask), reference log-probs near the policy's ~ -log V - 0.5 so that the k3 KL term
    stays moderate. Logits come out with unit scale."""
    return loss_inputs(batch, seq, hidden_size, vocab, seed=seed, device=device, dtype=SHORT_DTYPES[dtype],
                       min_length=math.ceil(min_completion_frac * seq), mask_dtype=torch.int64, requires_grad=True)


def _loss_config(softcap):
    from grpo_fast import GRPOLossConfig

    return GRPOLossConfig(**LOSS, softcap=softcap)


def make_loss(impl: str, x: dict, device: str, softcap):
    """A zero-argument callable returning the scalar loss (differentiable w.r.t. hidden and weight)."""
    if impl == "liger":
        if softcap is not None:
            raise ValueError("Liger's LigerFusedLinearGRPOLoss has no final-logit softcapping")
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except ImportError as e:
            raise ImportError("impl 'liger' needs liger-kernel: pip install 'grpo-fast[bench]'") from e
        from grpo_fast.benchmarking import liger_loss

        cfg = _loss_config(None)
        liger = liger_loss(cfg, compiled=torch.device(device).type == "cuda")

        def step():
            loss, _metrics = liger(x["hidden"], x["weight"], x["target_ids"], x["completion_mask"],
                                   x["advantages"], ref_per_token_logps=x["ref_logps"])
            return loss

        return step

    if impl == "liger_triton":
        if softcap is not None:
            raise ValueError("Liger's triton_grpo_loss has no final-logit softcapping")
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        except ImportError as e:
            raise ImportError("impl 'liger_triton' needs liger-kernel: pip install 'grpo-fast[bench]'") from e
        cfg = _loss_config(None)

        def step():
            # Liger wants [B, T + 1, V] logits (the last position is dropped): one extra hidden row, not a copy
            h = torch.cat([x["hidden"], x["hidden"][:, -1:]], dim=1)
            logits = h @ x["weight"].t()
            loss, _metrics = triton_grpo_loss(
                logits, None, x["ref_logps"], x["target_ids"], x["advantages"], x["completion_mask"],
                temperature=cfg.temperature, beta=cfg.beta, eps_low=cfg.epsilon_low, eps_high=cfg.eps_high,
                loss_type=cfg.loss_type.value, reduce=True)
            return loss

        return step

    if impl == "matmul":
        grad_logits = {}

        class _BareMatmuls:
            """``backward()`` runs d hidden = g @ W and d weight = g^T @ h for a fixed upstream g: with the logits
            matmul of the forward, the 6 N H V FLOPs every fused loss is measured against."""

            def __init__(self, logits):
                self.logits = logits

            def backward(self):
                if "g" not in grad_logits:
                    grad_logits["g"] = torch.randn_like(self.logits) * 1e-3
                self.logits.backward(grad_logits["g"])

            def detach(self):
                return torch.zeros(())

        def step():
            return _BareMatmuls(x["hidden"] @ x["weight"].t())

        return step

    from grpo_fast import grpo_loss

    cfg = _loss_config(softcap)

    def step():
        return grpo_loss(x["hidden"], x["weight"], x["target_ids"], x["advantages"], x["completion_mask"],
                         ref_logps=x["ref_logps"], config=cfg, impl=impl).loss

    return step


def _oracle_loss_fp64(x: dict, softcap) -> float:
    """The reference loss in float64, log-probs computed a row block at a time (row-wise identical, bounded RAM)."""
    from grpo_fast.reference import logprobs_reference, loss_from_logps_reference

    cfg = _loss_config(softcap)
    h = x["hidden"].detach().double().reshape(-1, x["hidden"].shape[-1])
    w = x["weight"].detach().double()
    y = x["target_ids"].reshape(-1)
    logps = torch.cat([
        logprobs_reference(h[i:i + REF_ROWS_FP64], w, y[i:i + REF_ROWS_FP64], None, cfg.temperature, cfg.softcap)
        for i in range(0, h.shape[0], REF_ROWS_FP64)
    ]).reshape(x["target_ids"].shape)
    out = loss_from_logps_reference(logps, x["advantages"].double(), x["completion_mask"],
                                    ref_logps=x["ref_logps"].double(), config=cfg)
    return float(out.loss)


def check_shape(*, impls: list, shape: dict, device: str, threads: int) -> dict:
    """Child process: the loss of every implementation (and the reference) and of the float64 oracle, same inputs."""
    torch.set_num_threads(threads)
    x = make_inputs(**shape["inputs"], device=device)
    oracle = _oracle_loss_fp64(x, shape["softcap"])
    losses, errors = {}, {}
    for impl in dict.fromkeys(["reference", *(i for i in impls if i not in NO_LOSS_IMPLS)]):  # reference: the bound
        try:
            with torch.no_grad():  # Liger differentiates inside its forward regardless
                losses[impl] = float(make_loss(impl, x, device, shape["softcap"])())
        except Exception as e:  # noqa: BLE001 (recorded per implementation, the others still run)
            errors[impl] = f"{type(e).__name__}: {e}"
    return {"oracle": oracle, "losses": losses, "errors": errors}


def time_config(*, impl: str, shape: dict, device: str, threads: int, warmup: int, reps: int) -> dict:
    """Child process: warm-up and timed forward + backward steps of one implementation on one shape."""
    torch.set_num_threads(threads)
    x = make_inputs(**shape["inputs"], device=device)
    loss_fn = make_loss(impl, x, device, shape["softcap"])
    _prime(impl, shape, device)
    first = []

    def clear_grads():
        x["hidden"].grad = None
        x["weight"].grad = None

    def step():
        loss = loss_fn()
        loss.backward()
        if not first:
            first.append(float(loss.detach()))

    m = harness.measure(step, warmup=warmup, reps=reps, device=device, setup=clear_grads)
    grads = sum(t.numel() * t.element_size() for t in (x["hidden"], x["weight"]))
    return {"median_ms": m.median_ms, "min_ms": m.min_ms, "times_ms": list(m.times_ms),
            "peak_extra_bytes": m.peak_extra_bytes, "grads_bytes": grads, "memory_method": m.memory_method,
            "loss": first[0]}


def _prime(impl: str, shape: dict, device: str) -> None:
    """One step of ``impl`` on tiny inputs: its lazy imports, dispatcher set-up, BLAS and thread pools are one-off
    costs of a process, not memory a training step needs, so they happen before the memory baseline."""
    tiny = make_inputs(**dict(shape["inputs"], batch=2, seq=8, hidden_size=16, vocab=64), device=device)
    make_loss(impl, tiny, device, shape["softcap"])().backward()


# --------------------------------------------------------------------------------------------------------------------
# The driver (parent process)


def _parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_loss",
        description="Time and measure the peak memory of the GRPO loss forward+backward (from hidden states and the "
                    "lm_head weight) for grpo-fast's torch path, the materialised-logits reference and Liger-Kernel's "
                    "LigerFusedLinearGRPOLoss, each configuration in its own process. Loss: DAPO, beta 0.04 with "
                    "reference log-probs, epsilon 0.2, temperature 1.0.",
        epilog="Examples:\n"
               "  python -m bench.bench_loss                                   # N=4096, H=1024, V=32768 and 151936\n"
               "  python -m bench.bench_loss --n 256 --h 64 --vocab 1024 4096  # a quick smoke run\n"
               "  python -m bench.bench_loss --model qwen2.5-0.5b llama-3.2-1b # H and V from the model registry\n"
               "  python -m bench.plot bench/results/loss_cpu.csv              # bar chart next to the CSV\n"
               f"Registry models: {', '.join(MODELS)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--n", type=int, default=4096, help="tokens per step N = B * T (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="sequences B; T = N / B (default 4)")
    p.add_argument("--h", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936], metavar="V",
                   help="vocabulary sizes V to run (default 32768 151936)")
    p.add_argument("--model", nargs="+", default=None, metavar="NAME",
                   help="take H, V (and the final-logit softcap) from the model registry instead of --h/--vocab")
    p.add_argument("--dtype", choices=sorted(SHORT_DTYPES), default="fp32", help="hidden/weight dtype (default fp32)")
    p.add_argument("--impls", nargs="+", choices=ALL_IMPLS, default=None,
                   help="implementations to compare (default: torch reference liger, plus triton on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per config (default 1 on CPU, 3 on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per config (default 3 on CPU, 20 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--min-completion-frac", type=float, default=1.0, metavar="F",
                   help="each sequence's completion length is uniform in [F*T, T] and the rest is masked padding "
                        "(default 1.0: no padding, so every token does work and TFLOP/s is exact)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--csv", type=Path, default=None,
                   help="output CSV, overwritten (default bench/results/loss_<device>.csv)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check against the float64 oracle")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration process (default 3600)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="CPU: address-space cap per configuration process, so an oversized config fails cleanly "
                        "instead of invoking the OOM killer (default 90%% of MemAvailable; 0 = no cap)")
    p.add_argument("--plot", action="store_true", help="also write the PNG chart next to the CSV")
    args = p.parse_args(argv)
    if args.n % args.batch:
        p.error(f"--n ({args.n}) must be a multiple of --batch ({args.batch})")
    if not 0.0 < args.min_completion_frac <= 1.0:
        p.error("--min-completion-frac must be in (0, 1]")
    return args


def _shapes(args) -> list[dict]:
    common = dict(batch=args.batch, seq=args.n // args.batch, dtype=args.dtype, seed=args.seed,
                  min_completion_frac=args.min_completion_frac)
    if args.model:
        models = [get_model(name) for name in args.model]
        return [{"model": m.name, "softcap": m.final_logit_softcapping,
                 "inputs": dict(common, hidden_size=m.hidden_size, vocab=m.vocab_size)} for m in models]
    return [{"model": "", "softcap": None, "inputs": dict(common, hidden_size=args.h, vocab=v)} for v in args.vocab]


def _default_impls(device: str) -> list[str]:
    if torch.device(device).type == "cuda":
        return ["triton", "reference", "liger", "liger_triton", "matmul"]
    return ["torch", "reference", "liger"]


def _check(shape, impls, run) -> dict:
    """Per implementation ``{"loss", "err", "bound", "check"}`` or ``{"check": "error: ..."}``, printed as it goes."""
    from grpo_fast.testing import ATOL

    try:
        res = harness.run_isolated("bench.bench_loss:check_shape",
                                   dict(impls=impls, shape=shape, device=run["device"], threads=run["threads"]),
                                   timeout=run["timeout"], mem_limit_bytes=run["mem_limit"])
    except harness.IsolatedError as e:
        print(f"    check process failed: {e}", flush=True)
        return {impl: {"check": f"error: {e}"} for impl in impls}
    oracle, losses = res["oracle"], res["losses"]
    if "reference" not in losses:
        msg = f"error: the reference failed: {res['errors'].get('reference')}"
        print(f"    check: {msg}", flush=True)
        return {impl: {"check": msg} for impl in impls}
    bound = 2.0 * abs(losses["reference"] - oracle) + ATOL[SHORT_DTYPES[shape["inputs"]["dtype"]]]
    out = {}
    for impl in impls:
        if impl in NO_LOSS_IMPLS:
            out[impl] = {"check": "n/a (timing floor, no loss)"}
        elif impl in losses:
            err = abs(losses[impl] - oracle)
            out[impl] = {"loss": losses[impl], "err": err, "bound": bound, "check": "ok" if err <= bound else "FAIL"}
            print(f"    check {impl:>9}: loss {losses[impl]:+.8f}  |loss - fp64 oracle| = {err:.2e}  "
                  f"(bound {bound:.2e})  {out[impl]['check']}", flush=True)
        else:
            out[impl] = {"check": f"error: {res['errors'][impl]}"}
            print(f"    check {impl:>9}: {out[impl]['check']}", flush=True)
    return out


def _base_row(impl, shape, run) -> dict:
    inp = shape["inputs"]
    return {"benchmark": BENCHMARK, "impl": impl, "model": shape["model"], "B": inp["batch"], "T": inp["seq"],
            "N": inp["batch"] * inp["seq"], "H": inp["hidden_size"], "V": inp["vocab"],
            "softcap": shape["softcap"] or "", "dtype": inp["dtype"], "loss_type": LOSS["loss_type"],
            "beta": LOSS["beta"], "warmup": run["warmup"], "reps": run["reps"],
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # other work on the machine skews CPU timings


def _time_row(impl, shape, check, run) -> dict:
    """Time one (implementation, shape) in a fresh process; the CSV row, with ``error`` set if it failed."""
    row = _base_row(impl, shape, run)
    n, h, v = row["N"], row["H"], row["V"]
    env = harness.env_fields(run["device"])  # per row: the code this child process is about to import
    error = ""
    try:
        res = harness.run_isolated(
            "bench.bench_loss:time_config",
            dict(impl=impl, shape=shape, device=run["device"], threads=run["threads"], warmup=run["warmup"],
                 reps=run["reps"]),
            timeout=run["timeout"], mem_limit_bytes=run["mem_limit"])
    except harness.IsolatedError as e:
        res, error = None, str(e)
    if res is not None:
        if "loss" in check and not abs(res["loss"] - check["loss"]) <= check["bound"]:
            error = f"the timed step's loss {res['loss']} is not the checked loss {check['loss']}"
        peak, grads = res["peak_extra_bytes"] / harness.MIB, res["grads_bytes"] / harness.MIB
        row.update(median_ms=round(res["median_ms"], 3), min_ms=round(res["min_ms"], 3),
                   peak_extra_mib=round(peak, 1), grads_mib=round(grads, 1), overhead_mib=round(peak - grads, 1),
                   tflops=round(harness.tflops(6 * n * h * v, res["median_ms"]), 4), loss=res["loss"],
                   memory_method=res["memory_method"], times_ms=";".join(f"{t:.1f}" for t in res["times_ms"]))
    row.update(loss_err_fp64=check.get("err", ""), err_bound=check.get("bound", ""), check=check["check"],
               error=error, **env)
    return row


def _progress(row: dict, seconds: float) -> str:
    if "median_ms" not in row:
        return f"ERROR: {row['error']}"
    warn = f"  ({row['error']})" if row["error"] else ""
    return (f"{row['median_ms']:10.1f} ms (min {row['min_ms']:.1f}), peak +{row['peak_extra_mib']:,.1f} MiB "
            f"(grads {row['grads_mib']:,.1f}), {row['tflops']:.3f} TFLOP/s  [{seconds:.0f} s]{warn}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(device).type == "cuda"
    impls = args.impls or _default_impls(device)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    run = dict(device=device, threads=threads, timeout=args.timeout,
               warmup=args.warmup if args.warmup is not None else (3 if on_cuda else 1),
               reps=args.reps if args.reps is not None else (20 if on_cuda else 3),
               # RLIMIT_AS would also cap CUDA's virtual address reservations
               mem_limit=None if on_cuda else harness.default_mem_limit(args.mem_limit_gib))
    csv_path = args.csv or harness.RESULTS_DIR / f"loss_{torch.device(device).type}.csv"
    shapes = _shapes(args)

    env = harness.env_fields(device)
    print(f"grpo_loss fwd+bwd on {env['device']}, {threads} threads, torch {env['torch']}, commit {env['commit']}; "
          f"{len(shapes)} shape(s) x {len(impls)} impl(s), warmup {run['warmup']}, reps {run['reps']}"
          + (f", memory cap {run['mem_limit'] / 1024**3:.1f} GiB per process" if run["mem_limit"] else ""),
          flush=True)
    out, t_start, k = harness.CsvRows(csv_path), time.perf_counter(), 0  # each row on disk as soon as it exists
    failed = False
    for shape in shapes:
        inp = shape["inputs"]
        label = (shape["model"] + " " if shape["model"] else "") + \
            f"N={inp['batch'] * inp['seq']} H={inp['hidden_size']} V={inp['vocab']}"
        checks = {}
        if not args.no_check:
            print(f"  {label}: correctness check", flush=True)
            checks = _check(shape, impls, run)
            failed = checks.get("torch", {}).get("check") == "FAIL"
        if failed:  # no timing of a wrong result; the rows say why
            for i in impls:
                out.add(dict(_base_row(i, shape, run), check=checks[i]["check"], **env,
                             error="not timed: grpo-fast's torch path failed the correctness check"))
            break
        for impl in impls:
            k += 1
            print(f"  [{k}/{len(shapes) * len(impls)}] {label} {impl:>9} ... ", end="", flush=True)
            t0 = time.perf_counter()
            row = out.add(_time_row(impl, shape, checks.get(impl, {"check": "skipped"}), run))
            print(_progress(row, time.perf_counter() - t0), flush=True)

    rows = out.rows
    if len({r.get("src_sha") for r in rows}) > 1:
        print("\nWARNING: the source tree changed during the run; rows measured different code (see the commit and "
              "src_sha columns).", file=sys.stderr)
    print()
    print(results_table(rows))
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s; CSV: {csv_path}")
    if args.plot:
        from bench.plot import plot_csv

        print(f"plot: {plot_csv(csv_path)}")
    if failed:
        print("\nFAILED: grpo-fast's torch path disagrees with the float64 oracle beyond the tolerance rule "
              "(grpo_fast.testing); see the check lines above.", file=sys.stderr)
        return 1
    return 0


def results_table(rows: list[dict]) -> str:
    """Markdown: one line per (shape, impl), ratios against the reference on the same shape."""
    ref = {(r["model"], r["N"], r["H"], r["V"]): r for r in rows if r["impl"] == "reference" and "median_ms" in r}
    body = []
    for r in rows:
        shape = f"{r['model']} N={r['N']} H={r['H']}".strip()
        if "median_ms" not in r:
            body.append([r["impl"], shape, r["V"], "error", "", "", "", "", "", r["error"][:60]])
            continue
        base = ref.get((r["model"], r["N"], r["H"], r["V"]))
        t_ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else ""
        m_ratio = f"{r['peak_extra_mib'] / base['peak_extra_mib']:.3f}x" if base and base["peak_extra_mib"] else ""
        body.append([r["impl"], shape, r["V"], r["median_ms"], r["peak_extra_mib"], r["overhead_mib"],
                     f"{r['tflops']:.3f}", t_ratio, m_ratio, r["check"][:60]])
    return harness.markdown_table(
        ["impl", "shape", "V", "median ms", "peak extra MiB", "overhead MiB", "TFLOP/s", "time vs ref", "mem vs ref",
         "check"], body)


if __name__ == "__main__":
    sys.exit(main())
