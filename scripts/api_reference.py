"""docs/api.md, the API reference, generated from the docstrings of every public name.

    python scripts/api_reference.py            # rewrite docs/api.md; exit 1 naming any gap
    python scripts/api_reference.py --check    # exit 1 when docs/api.md is stale or has a gap
    python scripts/api_reference.py --doctest  # run every example, for real (below)

The public names are found, not listed: everything in ``distgrad.__all__``, and, for each
module in it (``errors``, ``losses``, ``parallel``, ``rpc``, ``testing``, and any added later),
everything in that module's ``__all__``, recursively (``rpc.functions``). A new public name
appears at the next run, and the run fails until its docstring has the sections below.

A docstring is prose with sections, each a heading alone on its line (``Args:``) and its
entries indented under it (``name: what it is``):

* a one-line summary (the first line), then the prose: semantics, gradient, cost;
* ``Args:`` every parameter of the signature, by name (``*args``, ``**kwargs`` as written);
  a dataclass lists its fields under ``Attributes:`` instead; a callable Protocol (a
  signature users implement, never construct) lists its ``__call__``'s parameters;
* ``Returns:`` for a function, what it returns (and for a callable Protocol, what the call
  returns);
* ``Raises:`` for a function or a class users construct, each error it raises on purpose and
  when (an error class has ``Raised by:`` instead: which calls raise it; a Protocol needs
  none: what raises is the user's implementation);
* ``Example:`` doctest lines (``>>>``) that ``--doctest`` runs.

Names distgrad re-exports from torch (``distgrad.rpc.BackendType``, ...) keep torch's
docstrings; their entries are written here, in ``TORCH_NAMES``, in the same form.

``--doctest`` runs each example in a fresh namespace holding ``torch`` and ``dg`` (distgrad), in
one process, as rank 0 of a one-rank gloo process group (so ``group=None`` is that group),
which the examples share. An example that uses ``dg.rpc`` also runs as ``worker0`` of a
one-worker RPC group started for it, unless it calls ``init_rpc`` itself. An example that
starts its own ranks (``run_on_ranks``, the checkers: on processes, or simulated with
``simulate=True``, which needs no process group in the caller) gets no group.
"""

from __future__ import annotations

import argparse
import dataclasses
import doctest
import inspect
import re
import sys
import tempfile
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"
COMMAND = "python scripts/api_reference.py"

SECTIONS = ("Args", "Attributes", "Returns", "Raises", "Raised by", "Example")
_HEADING = re.compile(rf"^({'|'.join(SECTIONS)}):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)\s*:\s?(.*)$")


# --------------------------------------------------------------------------- torch's names

TORCH_NAMES: dict[str, tuple[str, str]] = {
    # qualified name -> (signature, docstring in the form above)
    "distgrad.rpc.BackendType": (
        "distgrad.rpc.BackendType",
        """The RPC backends torch offers: torch's ``torch.distributed.rpc.BackendType``.

distgrad's ``init_rpc`` takes ``None`` or ``BackendType.TENSORPIPE`` (the only backend torch
ships) and refuses any other.

Example:
    >>> dg.rpc.BackendType.TENSORPIPE.name
    'TENSORPIPE'
""",
    ),
    "distgrad.rpc.TensorPipeRpcBackendOptions": (
        "distgrad.rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60.0, "
        "init_method='env://', device_maps=None, devices=None, _transports=None, "
        "_channels=None)",
        """The TensorPipe agent's options: torch's ``TensorPipeRpcBackendOptions``.

Pass it to ``init_rpc(rpc_backend_options=...)``, as with torch, or use ``init_rpc``'s
``init_method=``, ``timeout=`` and ``num_worker_threads=`` shortcuts, which build it.

Args:
    num_worker_threads: threads of the agent's pool (a distributed backward holds one per hop).
    rpc_timeout: seconds every RPC may take.
    init_method: the rendezvous URL (``"file:///path"``, ``"tcp://host:port"``, ``"env://"``).
    device_maps: where each peer's CUDA tensors land on this worker.
    devices: the CUDA devices the agent may use.
    _transports: torch's private choice of TensorPipe transports.
    _channels: torch's private choice of TensorPipe channels.

Raises:
    TypeError: an argument of the wrong type (torch's binding checks them).

Example:
    >>> options = dg.rpc.TensorPipeRpcBackendOptions(init_method="file:///tmp/x", rpc_timeout=30)
    >>> options.rpc_timeout, options.init_method
    (30.0, 'file:///tmp/x')
""",
    ),
    "distgrad.rpc.WorkerInfo": (
        "distgrad.rpc.WorkerInfo",
        """A worker's name and id: torch's ``torch.distributed.rpc.WorkerInfo``.

Made by the agent, never by users: ``get_worker_info()`` returns one, and ``rpc_sync``,
``rpc_async`` and ``remote`` take one wherever they take a worker's name.

Example:
    >>> info = dg.rpc.get_worker_info()
    >>> isinstance(info, dg.rpc.WorkerInfo), info.name, info.id
    (True, 'worker0', 0)
""",
    ),
    "distgrad.rpc.get_worker_info": (
        "distgrad.rpc.get_worker_info(worker_name=None)",
        """A worker's ``WorkerInfo``: torch's ``torch.distributed.rpc.get_worker_info``.

Args:
    worker_name: the worker's name; ``None`` for this worker.

Returns:
    The ``WorkerInfo`` (name and id) of that worker.

Raises:
    RuntimeError: RPC is not initialised, or no worker has that name.

Example:
    >>> dg.rpc.get_worker_info("worker0").id
    0
""",
    ),
    "distgrad.rpc.functions.async_execution": (
        "distgrad.rpc.functions.async_execution(fn)",
        """Mark ``fn`` as returning a future: torch's ``rpc.functions.async_execution``.

The callee answers when the future ``fn`` returns completes, not when ``fn`` returns. Called
through ``distgrad.rpc.rpc_sync``/``rpc_async``/``remote`` inside a context, the tensors of the
future's value that require grad are recorded like any call's result.

Args:
    fn: the function to mark; it must return a ``torch.futures.Future``.

Returns:
    ``fn``, marked (torch wraps it).

Raises:
    Nothing at decoration: a marked function that returns no future fails at the call.

Example:
    >>> @dg.rpc.functions.async_execution
    ... def doubled_later(x):
    ...     future = torch.futures.Future()
    ...     future.set_result(2 * x)
    ...     return future
    >>> doubled_later(torch.ones(2)).wait()  # called here, it returns its future
    tensor([2., 2.])
""",
    ),
}


# --------------------------------------------------------------------------- what is public


@dataclass
class Entry:
    """One public name: where it is, what it is, and its docstring's parts."""

    name: str  # qualified: distgrad.rpc.init_rpc
    obj: Any
    signature: str
    summary: str
    prose: str
    sections: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        if isinstance(self.obj, type) and issubclass(self.obj, BaseException):
            return "exception"
        if dataclasses.is_dataclass(self.obj):
            return "dataclass"
        if _protocol(self.obj):
            return "protocol"
        return "class" if isinstance(self.obj, type) else "function"

    def entries(self, section: str) -> dict[str, str]:
        """A section's ``name: text`` entries (continuation lines joined)."""
        found: dict[str, str] = {}
        last = None
        for line in self.sections.get(section, "").splitlines():
            match = _ENTRY.match(line) if not line.startswith(" ") else None
            if match:
                last = match.group(1)
                found[last] = match.group(2).strip()
            elif last is not None and line.strip():
                found[last] += " " + line.strip()
        return found


def public_modules() -> list[tuple[str, types.ModuleType]]:
    """distgrad and every module its __all__ names, recursively, in the order found."""
    import distgrad

    found = [("distgrad", distgrad)]
    for qualified, module in found:
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, types.ModuleType) and hasattr(value, "__all__"):
                found.append((f"{qualified}.{name}", value))
    return found


def _own(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "")).startswith("distgrad")


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _protocol(obj: Any) -> bool:
    return isinstance(obj, type) and bool(getattr(obj, "_is_protocol", False))


def _parameters(obj: Any) -> list[inspect.Parameter]:
    target = obj
    if _protocol(obj):  # never constructed: its parameters are those its callers pass
        call = obj.__dict__.get("__call__")
        if call is None:
            return []
        return [p for p in inspect.signature(call).parameters.values() if p.name != "self"]
    if isinstance(obj, type):
        if dataclasses.is_dataclass(obj):
            return []
        init = obj.__dict__.get("__init__")
        if init is None or issubclass(obj, BaseException):
            return []
        target = init
    try:
        params = list(inspect.signature(target).parameters.values())
    except ValueError:  # a constructor written in C (a Tensor subclass's): made, not called
        return []
    return [p for p in params if p.name != "self"]


def _signature(qualified: str, obj: Any) -> str:
    if _protocol(obj) and _parameters(obj):  # class X(Protocol), then its __call__
        call = _signature("__call__", obj.__dict__["__call__"])
        call = re.sub(
            r"^__call__\(\n?",
            lambda m: m.group(0) + ("    self,\n" if "\n" in m.group(0) else "self, "),
            call,
        )
        return f"class {qualified}(Protocol):\n    def " + call.replace("\n", "\n    ") + ": ..."
    if isinstance(obj, type) and (issubclass(obj, BaseException) or not _parameters(obj)):
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        if dataclasses.is_dataclass(obj):
            fields = [f"{f.name}: {_annotation(f.type)}" for f in dataclasses.fields(obj)]
            listed = "".join(f"    {f},\n" for f in fields)
            return f"@dataclass\nclass {qualified}(\n{listed})"
        return f"class {qualified}({bases})" if bases else f"class {qualified}"
    params = _parameters(obj)
    parts: list[str] = []
    kw_only_marked = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not kw_only_marked:
            if not any(q.kind is q.VAR_POSITIONAL for q in params[:i]):
                parts.append("*")
            kw_only_marked = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    returns = ""
    if not isinstance(obj, type):
        annotation = inspect.signature(obj).return_annotation
        if annotation is not inspect.Signature.empty:
            returns = f" -> {_annotation(annotation)}"
    head = f"class {qualified}" if isinstance(obj, type) else qualified
    one_line = f"{head}({', '.join(parts)}){returns}"
    if len(one_line) <= 96:
        return one_line
    return f"{head}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def parse(qualified: str, obj: Any, signature: str, doc: str) -> Entry:
    """Split a docstring into its summary, prose and sections."""
    lines = inspect.cleandoc(doc).splitlines() if doc.strip() else []
    first = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    summary = " ".join(" ".join(lines[:first]).split())  # the first paragraph, one line
    prose: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] = prose
    for line in lines[first:]:
        heading = _HEADING.match(line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
            continue
        if current is not prose and line.strip() and not line.startswith(" "):
            current = prose  # prose again after a section (kept, in order)
        current.append(line)
    text = {
        name: inspect.cleandoc("\n".join(body)) if any(b.strip() for b in body) else ""
        for name, body in sections.items()
    }
    return Entry(qualified, obj, signature, summary, "\n".join(prose).strip(), text)


def entries() -> Iterator[Entry]:
    """Every public name that is not a module, in the order of its module's __all__."""
    for qualified, module in public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue
            full = f"{qualified}.{name}"
            if full in TORCH_NAMES:
                signature, doc = TORCH_NAMES[full]
            elif _own(obj):
                signature, doc = _signature(full, obj), obj.__doc__ or ""
            else:
                signature, doc = full, ""  # a re-export nobody described: a gap, below
            yield parse(full, obj, signature, doc)


def gaps(entry: Entry) -> list[str]:
    """What the entry lacks, each as a sentence naming the name."""
    found = []
    where = entry.name
    if not entry.summary:
        return [f"{where}: no docstring (or no entry in TORCH_NAMES for a name from torch)"]
    kind = entry.kind
    if kind == "dataclass":
        wanted = {f.name for f in dataclasses.fields(entry.obj)}
        listed = set(entry.entries("Attributes"))
        if wanted != listed:
            found.append(
                f"{where}: Attributes: lists {sorted(listed)}, the fields are {sorted(wanted)}"
            )
    elif entry.name not in TORCH_NAMES or "Args" in entry.sections:
        wanted = set()
        if entry.name not in TORCH_NAMES:
            for p in _parameters(entry.obj):
                wanted.add({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
        else:
            wanted = set(re.findall(r"[(,] ?(\*{0,2}\w+)(?==|,|\))", entry.signature))
        listed = set(entry.entries("Args"))
        if wanted != listed:
            missing, extra = sorted(wanted - listed), sorted(listed - wanted)
            found.append(f"{where}: Args: missing {missing}, not parameters {extra}")
    returns = kind == "function" or (kind == "protocol" and bool(_parameters(entry.obj)))
    if returns and not entry.sections.get("Returns"):
        found.append(f"{where}: no Returns: section")
    if kind == "exception":
        if not entry.sections.get("Raised by"):
            found.append(f"{where}: no Raised by: section")
    elif (kind == "function" or (kind == "class" and _parameters(entry.obj))) and not (
        entry.sections.get("Raises")
    ):
        found.append(f"{where}: no Raises: section")
    if ">>>" not in entry.sections.get("Example", ""):
        found.append(f"{where}: no Example: section with doctest lines (>>>)")
    return found


# --------------------------------------------------------------------------- the page


def _markdown(text: str) -> str:
    """reST inline markup as Markdown: ``x`` and :role:`~a.b.c` become `x` and `c`."""
    text = re.sub(r":\w+:`~[\w.]*?\.(\w+)`", r"`\1`", text)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _anchor(name: str) -> str:
    return re.sub(r"[^\w-]", "", name.lower())


def render(all_entries: list[Entry]) -> str:
    modules = public_modules()
    intro = (
        f"Generated from the docstrings by `{COMMAND}`; do not edit by hand (a test fails "
        "when this page and the docstrings differ). Every example runs as a doctest in CI "
        f"(`{COMMAND} --doctest`, from `tests/unit/test_api_reference.py`): in a namespace "
        "holding `torch` and `dg` (`import distgrad as dg`), as rank 0 of a one-rank gloo "
        "process group (so `group=None` is that group) and, where it uses `dg.rpc`, as "
        "`worker0` of a one-worker RPC group; an example that starts its own ranks "
        "(`dg.testing.run_on_ranks`, the checkers; `simulate=True` runs them in one process) "
        "runs without either. Semantics, gradients and costs at length: "
        "[semantics.md](semantics.md), [losses.md](losses.md), [patterns.md](patterns.md), "
        "[rpc.md](rpc.md), [checker.md](checker.md)."
    )
    out = ["# API reference", "", textwrap.fill(intro, 96), ""]
    by_module: dict[str, list[Entry]] = {}
    for entry in all_entries:
        by_module.setdefault(entry.name.rsplit(".", 1)[0], []).append(entry)
    for qualified, _ in modules:
        names = by_module.get(qualified, [])
        links = ", ".join(f"[`{e.name.rsplit('.', 1)[1]}`](#{_anchor(e.name)})" for e in names)
        out.append(f"* [`{qualified}`](#{_anchor(qualified)}): {links}")
    for qualified, module in modules:
        out += ["", f"## {qualified}", ""]
        doc = inspect.cleandoc(module.__doc__ or "").split("\n\n")[0]
        out += [_markdown(" ".join(doc.split())), ""]
        for entry in by_module.get(qualified, []):
            out += _render_entry(entry)
    return "\n".join(out).rstrip() + "\n"


def _render_entry(entry: Entry) -> list[str]:
    out = [f"### {entry.name}", "", "```python", entry.signature, "```", ""]
    out += [_markdown(entry.summary), ""]
    if entry.prose:
        out += [_markdown(entry.prose), ""]
    titles = {
        "Args": "Arguments",
        "Attributes": "Attributes",
        "Raises": "Raises",
        "Raised by": "Raised by",
    }
    for section in ("Args", "Attributes"):
        items = entry.entries(section)
        if items:
            out += [f"**{titles[section]}**", ""]
            out += [f"* `{name}`: {_markdown(text)}" for name, text in items.items()]
            out.append("")
    if entry.sections.get("Returns"):
        out += ["**Returns**: " + _markdown(" ".join(entry.sections["Returns"].split())), ""]
    for section in ("Raises", "Raised by"):
        text = entry.sections.get(section, "")
        if not text:
            continue
        items = entry.entries(section) if not text.startswith("Nothing") else {}
        out += [f"**{titles[section]}**", ""]
        if items:
            out += [f"* `{name}`: {_markdown(text)}" for name, text in items.items()]
        else:
            out.append(_markdown(" ".join(text.split())))
        out.append("")
    if entry.sections.get("Example"):
        out += ["**Example**", "", "```python", entry.sections["Example"], "```", ""]
    return out


# --------------------------------------------------------------------------- the doctests


def _process_group() -> None:
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mkdtemp(prefix="distgrad-doctest-") + "/store", 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# An example that starts its own ranks (processes, or simulated in this one) needs this
# process without a process group (simulate=True refuses one).
_OWN_RANKS = (
    "run_on_ranks(",
    "simulate=True",
    "check_against_single_process(",
    "check_parallel",
    "check_pipeline(",
)


def _with_group(entry: Entry) -> bool:
    return not any(marker in entry.sections["Example"] for marker in _OWN_RANKS)


def _with_rpc(entry: Entry) -> bool:
    example = entry.sections["Example"]
    return "dg.rpc." in example and "init_rpc(" not in example


def run_examples(only: str | None = None) -> tuple[int, int]:
    """Run every entry's example; (failed, attempted) examples, the failures printed.

    The examples that run in a process group share one (destroying a group costs distgrad's
    exit settle, 80 ms a group here: 4 s over the page); those that start their own ranks
    run after it is gone.
    """
    import os

    import torch
    import torch.distributed as dist

    import distgrad
    import distgrad.rpc

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    parser = doctest.DocTestParser()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    chosen = [
        e
        for e in entries()
        if ">>>" in e.sections.get("Example", "") and (not only or only in e.name)
    ]
    failed = 0
    try:
        for entry in sorted(chosen, key=lambda e: not _with_group(e)):  # stable: page order
            if _with_group(entry) and not dist.is_initialized():
                _process_group()
            elif not _with_group(entry) and dist.is_initialized():
                dist.destroy_process_group()
            globs = {"torch": torch, "dg": distgrad, "__name__": "__doctest__"}
            test = parser.get_doctest(entry.sections["Example"], globs, entry.name, entry.name, 0)
            runner = doctest.DocTestRunner(optionflags=flags)
            rpc = _with_rpc(entry)
            if rpc:
                folder = tempfile.mkdtemp(prefix="distgrad-doctest-rpc-")
                distgrad.rpc.init_rpc(
                    "worker0", rank=0, world_size=1, init_method=f"file://{folder}/rpc"
                )
            try:
                failed += bool(runner.run(test).failed)
            finally:
                if rpc:
                    distgrad.rpc.shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return failed, len(chosen)


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    parser.add_argument("--doctest", action="store_true", help="run every example")
    parser.add_argument("--only", help="with --doctest: names containing this only")
    args = parser.parse_args(argv)
    if args.doctest:
        failed, attempted = run_examples(args.only)
        print(f"api reference examples: {attempted - failed} of {attempted} passed")
        return 1 if failed or not attempted else 0
    all_entries = list(entries())
    problems = [gap for entry in all_entries for gap in gaps(entry)]
    page = render(all_entries)
    for problem in problems:
        print(problem, file=sys.stderr)
    if args.check:
        if OUTPUT.read_text() != page:
            print(f"docs/api.md is stale: run `{COMMAND}` and commit it", file=sys.stderr)
            return 1
        return 1 if problems else 0
    OUTPUT.write_text(page)
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {len(all_entries)} names, {len(problems)} gaps")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
