"""docs/api.md is the reference generated from the docstrings, current, complete, and its
examples run.

Semantics asserted:

* the page in the repository is what ``python scripts/api_reference.py`` writes now, so a
  docstring changed without regenerating it fails here, with the command to run;
* every public name (``distgrad.__all__`` and, recursively, the ``__all__`` of every public
  module in it) has its one-line summary, its arguments (every parameter of its signature, by
  name), what it returns, what it raises, and an example, and appears on the page;
* every example runs, for real, as a doctest (``--doctest``: one process, a one-rank gloo
  group, a one-worker RPC group for ``dg.rpc``; the examples that start ranks start them),
  and all of them are run, none skipped;
* the checker of those sections refuses a name without them (a stand-in function defined
  here, with and without its sections), and every collective says what it raises.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Protocol

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "api_reference.py"


def _reference() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["api_reference"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


api = _reference()


def test_docs_api_md_is_what_the_docstrings_generate() -> None:
    page = api.render(list(api.entries()))
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == page, f"docs/api.md is stale: run `{api.COMMAND}` and commit docs/api.md"


def test_every_public_name_has_its_summary_arguments_returns_raises_and_example() -> None:
    problems = [gap for entry in api.entries() for gap in api.gaps(entry)]
    assert not problems, (
        "public names whose docstrings lack a section (then run "
        f"`{api.COMMAND}`):\n" + "\n".join(problems)
    )


def test_every_public_name_is_on_the_page() -> None:
    names = {entry.name for entry in api.entries()}
    page = (ROOT / "docs" / "api.md").read_text()
    for qualified, module in api.public_modules():
        for name in module.__all__:
            if not isinstance(getattr(module, name), types.ModuleType):
                assert f"{qualified}.{name}" in names
                assert f"\n### {qualified}.{name}\n" in page, f"{qualified}.{name}"
    assert len(names) >= 74  # as many as when the page was made; other branches add more


def test_every_collective_says_what_it_raises() -> None:
    import distgrad.collectives

    for name in distgrad.collectives.__all__:
        entry = next(e for e in api.entries() if e.name == f"distgrad.{name}")
        raised = entry.entries("Raises")
        assert {"CollectiveArgumentError", "CollectiveMismatchError"} <= set(raised), name
        assert {"torch.distributed.DistBackendError", "RuntimeError"} <= set(raised), name


def _documented(x: int, *, scale: float = 1.0) -> int:
    """Scale ``x``.

    Args:
        x: the value.
        scale: the factor.

    Returns:
        ``x`` times ``scale``.

    Raises:
        TypeError: ``x`` is not a number.

    Example:
        >>> _documented(2)
        2
    """
    return int(x * scale)


def _undocumented(x: int, scale: float = 1.0) -> int:
    """Scale ``x``; a docstring without its sections."""
    return int(x * scale)


class _Program(Protocol):
    """A callable Protocol: a signature users implement, never construct.

    Args:
        x: the value.

    Returns:
        The result.

    Example:
        >>> 1
        1
    """

    def __call__(self, x: int, /) -> int: ...


def test_a_callable_protocol_is_checked_by_its_call() -> None:
    """A Protocol's entry lists its ``__call__``'s parameters (not the ``*args, **kwargs`` of
    the constructor typing gives it) and what the call returns; no Raises (the
    implementation raises, not the Protocol); its signature shows the ``__call__``."""
    signature = api._signature("tests.Program", _Program)
    assert signature.startswith("class tests.Program(Protocol):\n    def __call__(self, x: int")
    assert api.gaps(api.parse("tests.Program", _Program, signature, _Program.__doc__)) == []
    bare = api.parse("tests.Program", _Program, signature, "A Protocol with no sections.")
    assert api.gaps(bare) == [
        "tests.Program: Args: missing ['x'], not parameters []",
        "tests.Program: no Returns: section",
        "tests.Program: no Example: section with doctest lines (>>>)",
    ]


def test_the_checker_refuses_a_name_without_its_sections() -> None:
    """The sections' checker on two stand-ins: the documented one passes, the other is named
    once per missing section, and an argument left out of Args is named."""

    def entry(fn: object) -> object:
        return api.parse("tests.stand_in", fn, api._signature("tests.stand_in", fn), fn.__doc__)

    assert api.gaps(entry(_documented)) == []
    gaps = api.gaps(entry(_undocumented))
    assert any("Args: missing ['scale', 'x']" in g for g in gaps), gaps
    assert any("no Returns" in g for g in gaps) and any("no Raises" in g for g in gaps)
    assert any("no Example" in g for g in gaps), gaps
    half = _documented.__doc__.replace("        scale: the factor.\n", "")  # type: ignore[union-attr]
    parsed = api.parse("tests.stand_in", _documented, "", half)
    assert api.gaps(parsed) == ["tests.stand_in: Args: missing ['scale'], not parameters []"]


def test_every_example_runs_as_a_doctest() -> None:
    """``scripts/api_reference.py --doctest`` in a process of its own (it makes a process
    group and RPC groups): every example passes, and every public name's example ran."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--doctest"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    count = len(list(api.entries()))
    assert f"api reference examples: {count} of {count} passed" in result.stdout, result.stdout


def test_the_command_says_how_to_regenerate_a_stale_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--check`` on a page that differs from the docstrings exits 1 and names the command."""
    stale = tmp_path / "api.md"
    stale.write_text("# API reference\n")
    monkeypatch.setattr(api, "OUTPUT", stale)
    assert api.main(["--check"]) == 1
    assert f"docs/api.md is stale: run `{api.COMMAND}`" in capsys.readouterr().err
