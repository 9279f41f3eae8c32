"""The `distgrad` command: `distgrad demo` and `distgrad check`.

Exit codes: 0 success (check: gradients agree), 1 check found a mismatch or the checked function
failed, 2 bad arguments. Every error goes to stderr and starts with the same prefix,
``distgrad: error:``; a bad argument is that one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import torch

from distgrad import __version__
from distgrad.errors import DistgradError

__all__ = ["main"]

PREFIX = "distgrad: error:"  # every error the command prints starts with it
# Said from a clone, where the README's install ran: the demo extra brings matplotlib.
NO_PLOT = (
    "no plot: matplotlib is not installed; for curves.png, in your clone of distgrad: "
    'pip install -e ".[demo]" (or pip install matplotlib)'
)


class _UsageError(DistgradError):
    """A bad argument, reported in one line with exit code 2 (never leaves this module)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line (and a pointer to --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PREFIX} {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except _UsageError as exc:
        parser.exit(2, f"{PREFIX} {exc}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}"
        ) from None
    if min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"sizes must not be negative, got {text!r}")
    return sizes


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="distgrad",
        description="Differentiable collectives with gradients checked against one process.",
    )
    parser.add_argument("--version", action="version", version=f"distgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small contrastive model three ways and compare the gradients",
        description=(
            "Train a small NT-Xent model on synthetic data three ways: one process on the full "
            "batch, N processes with distgrad, and N processes with a naive local-only "
            "GatherLayer. Prints a table and writes a markdown report with a PNG plot."
        ),
    )
    demo.add_argument("--world-size", type=_positive, default=2, help="processes (default 2)")
    demo.add_argument("--steps", type=_positive, default=60, help="SGD steps (default 60)")
    demo.add_argument(
        "--batch",
        type=_positive,
        default=None,
        help="global batch, a multiple of --world-size (default 32 per process)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument(
        "--output",
        type=Path,
        default=Path("distgrad-demo"),
        help="folder for report.md and curves.png (default ./distgrad-demo)",
    )
    demo.set_defaults(run=_run_demo)
    check = sub.add_parser(
        "check",
        help="compare a distributed loss with its single-process truth",
        description=(
            "Run FUNCTION on one process on the whole batch and on N processes on shards, and "
            "compare the loss and the gradients. TARGET is MODULE:FUNCTION or FILE.py:FUNCTION. "
            "FUNCTION(*inputs) or FUNCTION(model, *inputs) returns this rank's scalar loss; the "
            "same module defines make_inputs() returning the global batch (a tuple of tensors, "
            "passed in order, or a dict of tensors, passed by parameter name; split along dim "
            "0) and, optionally, make_model() returning an nn.Module."
        ),
    )
    check.add_argument("target", metavar="TARGET", help="MODULE:FUNCTION or FILE.py:FUNCTION")
    check.add_argument(
        "--world-size", type=_positive, default=2, help="ranks (default 2): processes, or simulated"
    )
    check.add_argument("--inputs", default="make_inputs", help="inputs function (make_inputs)")
    check.add_argument("--model", default=None, help="model factory (default: make_model if any)")
    check.add_argument(
        "--gradients",
        choices=["averaged", "summed"],
        default="averaged",
        help="how training combines the ranks' gradients (default: averaged, as DDP does)",
    )
    check.add_argument(
        "--shard-sizes",
        type=_sizes,
        default=None,
        metavar="N,N,...",
        help="rows per rank, e.g. 3,1 (default: as even as possible)",
    )
    check.add_argument("--rtol", type=float, default=None, help="relative tolerance")
    check.add_argument("--atol", type=float, default=None, help="absolute tolerance")
    check.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    check.add_argument(
        "--no-debug",
        action="store_true",
        help="run the ranks without distgrad's debug mode (for code whose ranks legitimately "
        "call a collective from different lines)",
    )
    check.add_argument(
        "--simulate",
        action="store_true",
        help="run every rank in this process (torch's LocalTensorMode) instead of starting "
        "processes; refused, with the reason, for code that cannot be simulated",
    )
    check.set_defaults(run=_run_check)
    return parser


# --------------------------------------------------------------------------- demo


def _run_demo(args: argparse.Namespace) -> int:
    from distgrad._demo import report, train
    from distgrad.testing import run_on_ranks

    out = _writable_folder(args.output)
    batch = 32 * args.world_size if args.batch is None else args.batch
    if batch % args.world_size:
        raise _UsageError(f"--batch {batch} must divide evenly over --world-size {args.world_size}")
    settings = train.Settings(args.world_size, args.steps, batch, args.seed)
    started = time.perf_counter()
    print(
        f"distgrad demo: {settings.steps} steps, global batch {settings.batch}, "
        f"{settings.world_size} processes",
        file=sys.stderr,
    )
    single, trajectory = train.train_single(settings)
    curves = [single]
    for naive in (False, True):
        results = run_on_ranks(
            train.train_distributed,
            settings.world_size,
            args=(settings, naive, trajectory),
            timeout=600,
        )
        curves.append(results[0])
    seconds = time.perf_counter() - started
    png = "curves.png" if report.plot(curves, out / "curves.png") else None
    (out / "report.md").write_text(report.markdown(curves, settings, png, seconds))
    print()
    print(report.table(curves))
    print()
    print(f"report: {out / 'report.md'}")
    if png is None:
        print(NO_PLOT)
    else:
        print(f"plot:   {out / png}")
    return 0


def _writable_folder(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _UsageError(f"cannot create the output folder {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise _UsageError(f"the output folder {path} is not writable")
    return path


# --------------------------------------------------------------------------- check


def _run_check(args: argparse.Namespace) -> int:
    from distgrad.errors import CheckArgumentError, NotALossError, RankFailedError
    from distgrad.testing import check_against_single_process

    module, name = _load_target(args.target)
    fn = _attribute(module, name, args.target)
    make_inputs = _attribute(module, args.inputs, f"{module.__name__}:{args.inputs}")
    make_model = _model_factory(module, args.model)
    inputs = _global_batch(make_inputs, f"{module.__name__}:{args.inputs}")
    try:
        report = check_against_single_process(
            fn,
            inputs,
            world_size=args.world_size,
            model=make_model,
            shard_sizes=args.shard_sizes,
            gradients=args.gradients,
            rtol=args.rtol,
            atol=args.atol,
            timeout=args.timeout,
            debug=not args.no_debug,
            simulate=args.simulate,
        )
    except NotALossError as exc:
        raise _UsageError(f"{name}: {exc}") from None
    except CheckArgumentError as exc:
        raise _UsageError(str(exc)) from None
    except RankFailedError as exc:
        print(f"{PREFIX} {name} failed on the ranks:\n{exc}", file=sys.stderr)
        return 1
    except Exception:
        return _function_failed(name)
    print(report)
    return 0 if report.ok else 1


def _function_failed(name: str) -> int:
    """The user's function (or model factory) raised in the single-process run."""
    import traceback

    print(f"{PREFIX} {name} failed in the single-process run:", file=sys.stderr)
    traceback.print_exc()
    return 1


def _global_batch(
    make_inputs: Callable[..., Any], label: str
) -> Mapping[str, torch.Tensor] | Sequence[torch.Tensor]:
    try:
        inputs = make_inputs()
    except Exception as exc:
        raise _UsageError(f"{label}() raised {type(exc).__name__}: {exc}") from None
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    values = list(inputs.values()) if isinstance(inputs, Mapping) else inputs
    if not isinstance(inputs, (Mapping, tuple, list)) or not all(
        isinstance(v, torch.Tensor) for v in values
    ):
        found = type(inputs).__name__
        if isinstance(inputs, (Mapping, tuple, list)):
            found += " holding " + ", ".join(sorted({type(v).__name__ for v in values}))
        raise _UsageError(
            f"{label}() must return the global batch as a tensor, a tuple or list of tensors, "
            f"or a dict of name to tensor; got {found}"
        )
    if not values:
        raise _UsageError(f"{label}() returned no tensors")
    return inputs


def _load_target(target: str) -> tuple[ModuleType, str]:
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise _UsageError(
            f"TARGET must look like MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}"
        )
    if where.endswith(".py") or os.sep in where:
        return _load_file(Path(where)), name
    try:
        return importlib.import_module(where), name
    except ImportError as exc:
        raise _UsageError(f"cannot import module {where!r}: {exc}") from None


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise _UsageError(f"no such file: {path}")
    # The ranks import the function by module name, so the file's folder goes on sys.path and
    # the module is registered under its own name.
    folder, module_name = str(path.resolve().parent), path.stem
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise _UsageError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


def _attribute(module: ModuleType, name: str, label: str) -> Callable[..., Any]:
    value = getattr(module, name, None)
    if value is None:
        raise _UsageError(f"{label}: module {module.__name__!r} has no {name!r}")
    if not callable(value):
        raise _UsageError(f"{label}: {name!r} is not a function")
    return value  # type: ignore[no-any-return]


def _model_factory(module: ModuleType, name: str | None) -> Callable[..., Any] | None:
    if name is not None:
        return _attribute(module, name, f"{module.__name__}:{name}")
    found = getattr(module, "make_model", None)
    return found if callable(found) else None
