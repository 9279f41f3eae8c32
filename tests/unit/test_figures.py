"""Every figure the docs quote is read from a committed results file, so a rerun cannot leave a
page quoting numbers its results no longer hold.

Semantics asserted:

* **The sweep.** Every measured figure (a number with a unit: ``1.4x``, ``0.3 ms``, ``12 us``,
  ``3.1 GiB``, ``14%``; a range ``1.02x-1.32x`` counts each end) in the pages scanned sits in a
  block (a paragraph, a list item, a table, a code block) that names a committed results file
  (``results/<name>.md``, in the block, in a heading above it, or in the sentence ending in ``:``
  that introduces it), and every number of the figure appears in one of those files. A rerun
  that changes a number the docs quote fails here, naming the block.
* **History** lives in benchmarks/README.md only, under a heading that carries its date and
  the commit it measured: the numbers there are of that commit, read from the git history.
* **Named exceptions** (a constant of the code, an example of a message, a bar someone set):
  each one is a phrase listed below with its reason, and must still be on its page.
* **Quotes.** The figures the README and semantics quote from the tables others rerun
  (collectives.md, call_cost.md, simulate.md, guard.md, compiled_step.md) are computed from
  those tables here, cell by cell, and must appear as computed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from distgrad._exchange import wait

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

SCANNED = [
    "README.md",
    "CONTRIBUTING.md",
    "benchmarks/README.md",
    "docs/semantics.md",
    "docs/faults.md",
    "docs/lifecycle.md",
    "docs/patterns.md",
    "docs/ops.md",
    "docs/losses.md",
    "docs/checker.md",
    "docs/rpc.md",
]
# Not scanned here: pages whose figures another area's tests own.
NOT_SCANNED: dict[str, str] = {}

_NUM = r"\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:x|\s?(?:ms|us|µs|s|GiB|MiB|minutes)|%)(?!\w)"
FIGURE = re.compile(rf"(?<![\w.])(?:{_NUM}x?(?:-| to ))?{_NUM}{_UNIT}")
# Counts without a unit are figures too: "3 of the 144", "3 of those two rows' 20", "559 passed".
_OF = rf"of (?:the )?(?:[\w']+ ){{0,3}}?{_NUM}(?![\w.])"
COUNT = re.compile(rf"(?<![\w.]){_NUM} (?:{_OF}|(?:passed|failed|skipped)\b)")
CITED = re.compile(r"results/([\w.-]+\.md)")
DATE, COMMIT = re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), re.compile(r"\bcommit [0-9a-f]{7,40}\b")
HEADING = re.compile(r"^(#{1,6}) (.*)$")
ITEM = re.compile(r"^\s*(?:[*-]|\d+\.) ")


@dataclass(frozen=True)
class Excepted:
    """A figure that is not a measurement, and why; ``holds`` checks it against the code."""

    page: str
    phrase: str
    why: str
    holds: Callable[[], bool] = lambda: True


_WAIT = (ROOT / "src/distgrad/_exchange/wait.py").read_text()
_CONVENTIONS = (ROOT / "tests/losses/test_conventions.py").read_text()
_RPC_FAULTS = (ROOT / "tests/rpc/test_faults.py").read_text()
_RELEASE = (ROOT / "src/distgrad/rpc/_release.py").read_text()
_EXAMPLE = "an example of a message, not a measurement"


def _tick() -> bool:
    return wait.TICK_S == 0.02


EXCEPTIONS = [
    Excepted(
        "docs/lifecycle.md",
        "such helpers, up to 2 s",
        "the exit's grace for helper threads (inflight._HELPERS_GRACE_S)",
        lambda: (
            "_HELPERS_GRACE_S = 2.0" in (ROOT / "src/distgrad/_exchange/inflight.py").read_text()
        ),
    ),
    Excepted(
        "CONTRIBUTING.md",
        '("measured: 8.2 against 9.3 ms")',
        "an example of the comment style, not a claim about distgrad",
    ),
    Excepted("CONTRIBUTING.md", "over 2 GiB", "a test's input size, not a measurement"),
    Excepted("docs/faults.md", "0.11 s into the wait", _EXAMPLE),
    Excepted("docs/faults.md", "1.52 s into the wait", _EXAMPLE),
    Excepted("docs/faults.md", "timed out after 2.0 s", _EXAMPLE),
    Excepted("docs/faults.md", "(for 2.0 s)", _EXAMPLE),
    Excepted(
        "docs/faults.md",
        "**50 ms settle.** Resets already on their way get 50 ms to arrive, for all the peers at "
        "once (one `poll` of their liveness connections), not 50 ms per peer.",
        "the settle before a verdict, a constant of wait.py",
        lambda: "settle_s=0.05" in _WAIT,
    ),
    Excepted("docs/faults.md", "Every 20 ms tick", "the wait's tick (TICK_S)", _tick),
    Excepted("docs/faults.md", "ticks of 20 ms", "the wait's tick (TICK_S)", _tick),
    Excepted("docs/faults.md", "wakes every 20 ms", "the wait's tick (TICK_S)", _tick),
    Excepted("docs/faults.md", "per 20 ms tick", "the wait's tick (TICK_S)", _tick),
    Excepted(
        "docs/faults.md",
        "the ticks' 1 s retry",
        "how often an address is looked for again (alive._RETRY_S)",
        lambda: "_RETRY_S = 1.0" in (ROOT / "src/distgrad/_exchange/alive.py").read_text(),
    ),
    Excepted(
        "docs/faults.md",
        "waits up to 1 s for a timeout report",
        "the wait for the peers' reports (_REPORT_WAIT_S)",
        lambda: "_REPORT_WAIT_S = 1.0" in _WAIT,
    ),
    Excepted(
        "docs/faults.md",
        "plus up to 1 s",
        "the wait for the peers' reports (_REPORT_WAIT_S)",
        lambda: "_REPORT_WAIT_S = 1.0" in _WAIT,
    ),
    Excepted(
        "docs/faults.md",
        "reads its peers' reports for up to 1 s",
        "the wait for the peers' reports (_REPORT_WAIT_S)",
        lambda: "_REPORT_WAIT_S = 1.0" in _WAIT,
    ),
    Excepted(
        "docs/faults.md",
        "(0.5 s of slack for the ranks' clocks) or in the last 5 s",
        "how recent a peer's report must be (_CLOCK_SLACK_S, _RECENT_S)",
        lambda: "_CLOCK_SLACK_S = 0.5" in _WAIT and "_RECENT_S = 5.0" in _WAIT,
    ),
    Excepted(
        "docs/faults.md",
        "lasted 1 s also writes what it waits in",
        "when a wait notes what it waits in (_NOTE_AFTER_S)",
        lambda: "_NOTE_AFTER_S = 1.0" in _WAIT,
    ),
    Excepted(
        "docs/faults.md",
        "per wait that lasts 1 s",
        "when a wait notes what it waits in (_NOTE_AFTER_S)",
        lambda: "_NOTE_AFTER_S = 1.0" in _WAIT,
    ),
    Excepted("docs/lifecycle.md", "one 20 ms tick", "the wait's tick (TICK_S)", _tick),
    Excepted(
        "docs/lifecycle.md",
        "threads 50 ms at exit",
        "the exit settle (group._SETTLE_S)",
        lambda: "_SETTLE_S = 0.05" in (ROOT / "src/distgrad/_exchange/group.py").read_text(),
    ),
    Excepted(
        "docs/lifecycle.md",
        "GIL for 50 ms",
        "the exit settle (group._SETTLE_S)",
        lambda: "_SETTLE_S = 0.05" in (ROOT / "src/distgrad/_exchange/group.py").read_text(),
    ),
    Excepted(
        "docs/lifecycle.md",
        "50 ms for each",
        "the exit settle (group._SETTLE_S)",
        lambda: "_SETTLE_S = 0.05" in (ROOT / "src/distgrad/_exchange/group.py").read_text(),
    ),
    Excepted(
        "docs/lifecycle.md",
        "does not exit within 5 s",
        "run_on_ranks's exit deadline (launch._EXIT_WITHIN_S)",
        lambda: _exit_within() == 5.0,
    ),
    Excepted(
        "docs/losses.md",
        "**2x** `nt_xent`'s mean",
        "SimCLR's objective counts both directions: a factor of the formula, which "
        "tests/losses/test_conventions.py asserts exactly",
        lambda: "assert_close(official, 2 * ours" in _CONVENTIONS,
    ),
    Excepted(
        "docs/losses.md",
        "encoder weight and bias at 0.5x on 2 ranks",
        "the factor 1/W at W = 2, which tests/losses/test_conventions.py asserts exactly",
        lambda: '{"param linear.weight": 0.5, "param linear.bias": 0.5}' in _CONVENTIONS,
    ),
    Excepted(
        "docs/losses.md",
        "at B = 32768 on 2 ranks that is 2 GiB per matrix",
        "arithmetic of the shape: [16384, 32768] float32 logits",
        lambda: (32768 // 2) * 32768 * 4 == 2 * 2**30,
    ),
    Excepted(
        "docs/rpc.md",
        "(`timeout`, default 60 s,",
        "init_rpc's default RPC timeout (_lifecycle._DEFAULT_TIMEOUT_S)",
        lambda: (
            "_DEFAULT_TIMEOUT_S = 60.0" in (ROOT / "src/distgrad/rpc/_lifecycle.py").read_text()
        ),
    ),
    Excepted(
        "docs/rpc.md",
        "find no call within 5 ms",
        "how long a release waits for a call to ride on (_release._GATHER_S)",
        lambda: "_GATHER_S = 0.005" in _RELEASE,
    ),
    Excepted(
        "docs/rpc.md",
        "one message per worker after 5 ms",
        "how long a release waits for a call to ride on (_release._GATHER_S)",
        lambda: "_GATHER_S = 0.005" in _RELEASE,
    ),
    Excepted(
        "docs/rpc.md",
        "the fault tests require both within 2 s",
        "the bound tests/rpc/test_faults.py sets on the errors' arrival",
        lambda: "assert time.monotonic() - start < 2.0" in _RPC_FAULTS,
    ),
    Excepted(
        "docs/rpc.md",
        "pings, every 0.25 s while",
        "the watchdog's period (_liveness.PERIOD_S)",
        lambda: "PERIOD_S = 0.25" in (ROOT / "src/distgrad/rpc/_liveness.py").read_text(),
    ),
    Excepted(
        "docs/rpc.md",
        "gone within 2 s of the kill in the fault tests",
        "the bound tests/rpc/test_faults.py sets on a dead root's context",
        lambda: "assert float(found[1]) < 2.0" in _RPC_FAULTS,
    ),
]


_DROP_IN = (ROOT / "tests/parallel/test_drop_in.py").read_text()
_SPEC = (ROOT / "tests/rpc/test_torch_spec.py").read_text()
_FOUND = "a count from the reproduction that found the bug, kept as its story, not a result"

EXCEPTIONS += [
    Excepted(
        "docs/checker.md",
        "1-2 of 4",
        "which stages of a 4-stage pipeline a test finds unaveraged (tests/testing/"
        "test_pipeline_check.py asserts them), not a measurement",
    ),
    Excepted(
        "README.md",
        "released within 2 s",
        "the bound tests/rpc/test_faults.py sets on a dead root's context",
        lambda: "assert float(found[1]) < 2.0" in _RPC_FAULTS,
    ),
    Excepted("docs/faults.md", "8 of 20 healthy torchrun jobs", _FOUND),
    Excepted("docs/lifecycle.md", "8 of 20 launches; plain torch 20 of 20 clean", _FOUND),
    Excepted("docs/lifecycle.md", "5 of 23 torchrun jobs", _FOUND),
    Excepted("docs/lifecycle.md", "(3 of 3 launches clean, against 0 of 1", _FOUND),
    Excepted("docs/rpc.md", "3 of 3 runs of the stress test", _FOUND),
    Excepted("docs/rpc.md", "seen in 2 of 8 runs", _FOUND),
    Excepted(
        "docs/patterns.md",
        "at least 4 of 8 random ones",
        "the bound tests/parallel/test_drop_in.py asserts over 8 seeds",
        lambda: "for seed in range(8):" in _DROP_IN and "assert differs >= 4" in _DROP_IN,
    ),
    Excepted(
        "docs/rpc.md",
        "43 of the 63",
        "a count of torch's DistAutogradTest cases that tests/rpc/test_torch_spec.py runs",
        lambda: "EXPECTED_FAILURES" in _SPEC,
    ),
]


def _exit_within() -> float:
    from distgrad.testing import launch

    return float(launch._EXIT_WITHIN_S)


# Blocks another engineer is rewriting now, each checked once its owner drops it from here.
OWNED_ELSEWHERE: dict[tuple[str, str], str] = {}

# Results files another engineer is producing now: a block that names only these is checked
# once the file is committed.
PENDING = {"compiled_step.md": "benchmarks/compiled_step.py is being rerun by its owner"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str
    headings: tuple[str, ...]
    intro: str  # the block before, when it ends with ":" (it introduces this one)

    def cited(self) -> set[str]:
        return set(CITED.findall(" ".join((self.text, self.intro, *self.headings))))

    def history(self) -> bool:
        return self.page == "benchmarks/README.md" and any(
            DATE.search(h) and COMMIT.search(h) for h in self.headings
        )


def blocks(page: str) -> Iterator[Block]:
    """The page's paragraphs, list items, tables and code blocks, each with its headings."""
    headings: list[tuple[int, str]] = []
    current: list[str] = []
    start, fenced, previous = 0, False, ""

    def flush() -> Iterator[Block]:
        nonlocal current, previous
        if current:
            text = "\n".join(current)
            intro = previous if previous.rstrip().endswith(":") else ""
            yield Block(page, start, text, tuple(h for _, h in headings), intro)
            previous, current = text, []

    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            if not fenced:
                yield from flush()
                start = number
            current.append(line)
            fenced = not fenced
            if not fenced:
                yield from flush()
            continue
        if fenced:
            current.append(line)
            continue
        heading = HEADING.match(line)
        if heading or not line.strip() or ITEM.match(line):
            yield from flush()
        if heading:
            level = len(heading.group(1))
            headings = [h for h in headings if h[0] < level] + [(level, heading.group(2))]
        elif line.strip():
            if not current:
                start = number
            current.append(line)
    yield from flush()


def _key(number: str) -> str:
    """A number as the results files may write it: 1.0 and 1.00 are 1, 1,435 is 1435."""
    value = number.replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


def numbers_of(name: str) -> set[str]:
    return {_key(n) for n in re.findall(_NUM, (RESULTS / name).read_text())}


def untraced(block: Block) -> list[str]:
    """This block's figures that no results file it names holds, with why."""
    if any(page == block.page and block.text.startswith(start) for page, start in OWNED_ELSEWHERE):
        return []
    text = " ".join(block.text.split())
    for quoted in _quoted(block.page):
        text = text.replace(quoted, "")
    for exception in EXCEPTIONS:
        if exception.page == block.page:
            text = text.replace(exception.phrase, "")
    figures = [m.group(0) for pattern in (FIGURE, COUNT) for m in pattern.finditer(text)]
    if not figures or block.history():
        return []
    cited = sorted(block.cited())
    if not cited:
        return [f"{figure!r}: the block names no results file" for figure in figures]
    missing = [name for name in cited if not (RESULTS / name).exists()]
    if missing and set(missing) <= set(PENDING) and len(missing) == len(cited):
        return []  # checked once its file is committed
    if missing:
        return [f"names {', '.join(missing)}, which is not committed"]
    held = set().union(*(numbers_of(name) for name in cited))
    return [
        f"{figure!r}: {number} is in none of {', '.join(cited)}"
        for figure in figures
        for number in re.findall(_NUM, figure)
        if _key(number) not in held
    ]


def test_every_figure_in_the_docs_is_read_from_a_results_file_it_names() -> None:
    problems = [
        f"{block.page}:{block.line}: {problem}"
        for page in SCANNED
        for block in blocks(page)
        for problem in untraced(block)
    ]
    assert not problems, "figures that no committed result holds:\n" + "\n".join(problems)


def test_every_named_exception_is_still_on_its_page_and_true() -> None:
    for exception in EXCEPTIONS:
        page = " ".join((ROOT / exception.page).read_text().split())
        assert exception.phrase in page, exception
        assert exception.holds(), f"{exception.page}: {exception.phrase!r}: {exception.why}"


def test_history_stays_in_benchmarks_readme() -> None:
    """A dated heading with its commit marks history; no other page keeps any."""
    for page in SCANNED:
        if page == "benchmarks/README.md":
            continue
        for line in (ROOT / page).read_text().splitlines():
            if HEADING.match(line):
                assert not (DATE.search(line) and COMMIT.search(line)), f"{page}: {line}"


def test_the_sweep_sees_figures_and_refuses_one_without_a_file() -> None:
    """The sweep itself: a figure with no file is reported, one its file holds is not."""
    assert [m.group(0) for m in FIGURE.finditer("1.4x-1.9x, 0.3 to 0.4 ms, 14%, 2x2, x86_64")] == [
        "1.4x-1.9x",
        "0.3 to 0.4 ms",
        "14%",
    ]
    loose = Block("README.md", 1, "it takes 10.7 s", (), "")
    assert untraced(loose) == ["'10.7 s': the block names no results file"]
    filed = _simulate_speedups()["distgrad check"]  # a range the results file holds
    held = Block("README.md", 1, f"{filed} faster (results/simulate.md)", (), "")
    assert untraced(held) == []
    low = filed.split("-")[0]
    wrong = Block("README.md", 1, f"{low}-99.9x faster (results/simulate.md)", (), "")
    assert untraced(wrong) == [f"'{low}-99.9x': 99.9 is in none of simulate.md"]


def test_pages_not_scanned_exist() -> None:
    for page in NOT_SCANNED:
        assert (ROOT / page).exists(), page
    assert not set(NOT_SCANNED) & set(SCANNED)


# --- Quotes: figures computed from the tables, cell by cell --------------------------------


def table(name: str, heading: str) -> dict[str, dict[str, str]]:
    """The first markdown table under ``heading`` in a results file: row name -> column -> cell."""
    text = (RESULTS / name).read_text()
    lines = text[text.index(heading) :].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return {row[0]: dict(zip(header, row, strict=True)) for row in body}


def _ratio(cell: str) -> float:
    return float(cell.split("x")[0])


def _span(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}x-{max(values):.{digits}f}x"


def _collectives() -> dict[str, dict[str, str]]:
    return table("collectives.md", "## 2 ranks: ratio to the torch Function")


def readme_what_a_call_sends() -> str:
    line = next(
        line
        for line in (RESULTS / "exchanges.md").read_text().splitlines()
        if line.startswith("* all_gather 4 KB")
    )
    micro = re.search(r"\(distgrad\) (\d+) us", line)
    assert micro is not None, line
    ratio = _collectives()["all_gather 32 KB"]["distgrad"].split()[0]
    return (
        f"an all_gather of 4 KB per rank takes {micro.group(1)} us alone "
        f"([results/exchanges.md](benchmarks/results/exchanges.md)), against {ratio} of a "
        "hand-written torch `autograd.Function`'s time for distgrad's whole 32 KB all_gather"
    )


def guard_cost() -> str:
    """The data guard's cost, one figure wherever it is quoted (README, semantics.md,
    benchmarks/README.md, set_guard's docstring): collectives.md's guard table, 2 ranks."""
    guard = table("collectives.md", "## The data guard's cost")
    wall = {row: float(cells["2 ranks: wall, CPU"].split("x")[0]) for row, cells in guard.items()}
    reducing = ("all_reduce", "reduce", "broadcast")  # the tag rides in a copy they make anyway
    reductions = [v for row, v in wall.items() if row.split()[0] in reducing]
    pieces = [v for row, v in wall.items() if row.split()[0] not in reducing]
    return (
        f"costs {_span(reductions)} on the reductions and broadcast and up to "
        f"{max(pieces):.2f}x on the ops that move pieces, on 2 gloo ranks"
    )


def guard_cpu() -> str:
    guard = table("collectives.md", "## The data guard's cost")
    cpu = [float(c["2 ranks: wall, CPU"].split(", ")[-1].rstrip("x")) for c in guard.values()]
    return f"the calling thread's CPU {_span(cpu)}"


def compiled_over_eager() -> str:
    """A compiled distgrad call over the same call eager, by size: the `distgrad compiled`
    cell over the `distgrad` cell of each row of collectives.md's 2-rank table."""
    rows = _collectives()
    spans = []
    for size in ("32 KB", "4 MB"):
        ratios = [
            _ratio(c["distgrad compiled"]) / _ratio(c["distgrad"])
            for r, c in rows.items()
            if r.endswith(size) and c["distgrad compiled"]
        ]
        spans.append(_span(ratios))
    return (
        f"a compiled distgrad call of 32 KB per rank on 2 gloo ranks takes {spans[0]} the "
        f"time of the same call eager (at 4 MB {spans[1]})"
    )


def _simulate_speedups() -> dict[str, str]:
    """Each check's speed-up range in results/simulate.md, by the check's name."""
    text = (RESULTS / "simulate.md").read_text()
    found = dict(
        re.findall(r"^- (.+?): simulated / processes .*\((\d+\.\dx-\d+\.\dx) faster\)", text, re.M)
    )
    assert len(found) == 3, found
    return found


def readme_simulate() -> str:
    x = _simulate_speedups()
    return (
        f"{x['README example (Python)']} faster for this example on 2 ranks, "
        f"{x['README example on 8 ranks (Python)']} on 8, and {x['distgrad check']} for "
        "`distgrad check`"
    )


def readme_checked_calls() -> str:
    from distgrad.collectives._signature import CHECKED_CALLS

    return f"The first {CHECKED_CALLS} calls on each group are checked across ranks"


def benchmarks_collectives() -> str:
    rows = _collectives()
    parts = []
    for size in ("32 KB", "1 MB", "4 MB"):
        mine = [_ratio(c["distgrad"]) for r, c in rows.items() if r.endswith(size)]
        funcol = [_ratio(c["funcol"]) for r, c in rows.items() if r.endswith(size) and c["funcol"]]
        parts.append(f"at {size} {_span(mine)} (funcol eager {_span(funcol)} where it has the op)")
    return "hand-written torch Function: " + ", ".join(parts) + "."


def benchmarks_call_cost() -> str:
    eager = table("call_cost.md", "## Eager")
    extra = [float(c["distgrad - torch"].strip("+ us")) for c in eager.values()]
    return (
        f"distgrad's forward+backward costs {min(extra):.1f}-{max(extra):.1f} us more than the "
        "hand-written Function's, op by op (the `distgrad - torch` column)"
    )


def semantics_compiled_guards() -> str | None:
    if not (RESULTS / "compiled_step.md").exists():
        return None  # PENDING: checked once committed
    guards = table("compiled_step.md", "## Guard lines of a compiled forward")
    ratios = [float(list(c.values())[-1]) for c in guards.values()]
    return f"a compiled forward's guard lines are {_span(ratios, 1)} funcol's"


QUOTES: list[tuple[str, Callable[[], str | None]]] = [
    ("README.md", readme_what_a_call_sends),
    ("README.md", guard_cost),
    ("docs/semantics.md", guard_cost),
    ("benchmarks/README.md", guard_cost),
    ("benchmarks/README.md", guard_cpu),
    ("src/distgrad/_exchange/guard.py", guard_cost),
    ("README.md", compiled_over_eager),
    ("README.md", readme_simulate),
    ("README.md", readme_checked_calls),
    ("benchmarks/README.md", benchmarks_collectives),
    ("benchmarks/README.md", benchmarks_call_cost),
    ("docs/semantics.md", semantics_compiled_guards),
]


# --- Cells: a figure quoted from one cell, named by its table's heading, row and column -----


_ANY = re.compile(rf"{_NUM}(?:x|\s?(?:ms|us|s|GiB|MiB|%))?")


@dataclass(frozen=True)
class Cell:
    """A figure a page quotes from one cell of a results table. ``phrase`` is the page's words
    with ``{}`` where the figure goes; the figure is the cell's first number, with its unit
    (``0.87x`` of ``0.87x (0.73-0.88)``), or the whole cell with ``whole=True`` (a count such
    as ``559 passed, 1 skipped``)."""

    page: str
    phrase: str
    file: str
    heading: str
    row: str
    column: str
    whole: bool = False

    def value(self) -> str:
        text = table(self.file, self.heading)[self.row][self.column]
        if self.whole:
            return text
        found = _ANY.search(text)
        assert found is not None, f"{self.file}: {self.row} / {self.column}: {text!r}"
        return found.group(0)

    def expected(self) -> str:
        return self.phrase.format(self.value())


def cell_problem(cell: Cell, text: str) -> str | None:
    """None when ``text`` (a page) quotes ``cell`` as the table holds it; otherwise what the
    page says and what the cell, named by its row and column, holds."""
    text = " ".join(text.split())
    if cell.expected() in text:
        return None
    before, _, after = cell.phrase.partition("{}")
    found = re.search(re.escape(before) + r"(.+?)" + re.escape(after), text)
    says = repr(found.group(1)) if found else "nothing of the phrase"
    return (
        f"{cell.page} says {says} where {cell.file}, table {cell.heading!r}, row {cell.row!r}, "
        f"column {cell.column!r} holds {cell.value()!r}"
    )


_FRONT = ("front_door.md", "# The README's two commands")
CELLS = [
    Cell(
        "README.md",
        "the demo took {} s (median of 3 runs)",
        *_FRONT,
        "distgrad demo",
        "median wall (s)",
    ),
    Cell("README.md", "the default tier {} s", *_FRONT, "python -m pytest -q", "median wall (s)"),
    Cell(
        "README.md",
        "s ({}), under a load average",
        *_FRONT,
        "python -m pytest -q",
        "result",
        whole=True,
    ),
]


@pytest.mark.parametrize("cell", CELLS, ids=[f"{c.page}: {c.row} / {c.column}" for c in CELLS])
def test_each_cell_quoted_is_what_its_row_and_column_hold(cell: Cell) -> None:
    problem = cell_problem(cell, (ROOT / cell.page).read_text())
    assert problem is None, problem


def test_a_figure_from_the_wrong_cell_is_caught() -> None:
    """A planted doc sentence quoting the guard's cost of all_gather at 1 MB where it names
    32 KB: the number is in the file, so the sweep (number in a named file) lets it through;
    the cell check names the row, the column and what the cell holds. A planted count that
    is in no results file is caught by the sweep."""
    guard = ("collectives.md", "## The data guard's cost")
    cell = Cell("README.md", "all_gather of 32 KB with the guard: {} of its time", *guard,
                "all_gather 32 KB", "2 ranks: wall, CPU")  # fmt: skip
    neighbour = Cell("README.md", "{}", *guard, "all_gather 1 MB", "2 ranks: wall, CPU")
    right, wrong = cell.expected(), cell.phrase.format(neighbour.value())
    assert right != wrong
    assert cell_problem(cell, f"In short, {right}.") is None
    planted = Block("README.md", 1, f"{wrong} (results/collectives.md)", (), "")
    assert untraced(planted) == []  # the number is in the file: the sweep alone misses it
    assert cell_problem(cell, planted.text) == (
        f"README.md says {neighbour.value()!r} where collectives.md, table "
        f"\"## The data guard's cost\", row 'all_gather 32 KB', column '2 ranks: wall, CPU' "
        f"holds {cell.value()!r}"
    )
    count = Block("docs/faults.md", 1, "3 of the 1447 errors (results/faults.md)", (), "")
    assert untraced(count) == ["'3 of the 1447': 1447 is in none of faults.md"]


def _quoted(page: str) -> list[str]:
    texts = [quote() for where, quote in QUOTES if where == page]
    texts += [cell.expected() for cell in CELLS if cell.page == page]
    return [text for text in texts if text is not None]


@pytest.mark.parametrize(("page", "quote"), QUOTES, ids=[q.__name__ for _, q in QUOTES])
def test_each_quoted_figure_is_what_its_results_table_says(
    page: str, quote: Callable[[], str | None]
) -> None:
    expected = quote()
    if expected is None:
        pytest.skip(f"{quote.__name__}: its results file is not committed yet")
    text = " ".join((ROOT / page).read_text().split())
    assert expected in text, f"{page} should say, from the results: {expected!r}"


if __name__ == "__main__":  # list what the sweep finds, page by page
    for page in SCANNED:
        for block in blocks(page):
            for problem in untraced(block):
                print(f"{page}:{block.line}: {problem}")
    pytest.main([__file__, "-q"])
