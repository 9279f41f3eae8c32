"""The bug gallery (examples/bug_zoo/): every file reproduces a public gradient bug, and the
checker's diagnosis names the wrong tensors and their ratio.

Semantics asserted: each file's ``check()`` (``check_against_single_process`` on 2 real ranks,
float64) reports a mismatch, and its diagnosis is the one docs/checker.md's gallery gives
for that bug: the tensors named and the factor (1/2 or 2 on 2 ranks), or that the forward
already differs; open_clip #616's code, checked as summed, is exact under averaging. Every
file is in the default tier (about 0.3 s each once the ranks' forkserver is up).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ZOO = Path(__file__).resolve().parents[2] / "examples" / "bug_zoo"

# file -> what its diagnosis must say
DIAGNOSES = {
    "lightly_1920_sigreg": "every gradient is scaled by 1/2 (z)",
    "lightly_1977_barlow_twins": "every gradient is scaled by 1/2 (z1 and z2)",
    "st_3453_pnnpnn": "fit no convention (each rank's loss equal to the single-process 3.17676, "
    "or their sum equal to it, or to N times it); their mean is 3.39 times it",
    "open_clip_616_all_gather": "every gradient is scaled by 2 (image and text)",
    "open_clip_default_cliploss": "every gradient is scaled by 1/2 (image and text)",
    "stable_pretraining_409": "their mean is 0.683 times it",
    "logit_scale_double_average": "the gradient of param logit_scale (images, texts, "
    "param image.weight and param text.weight agree) is scaled by 2",
}


def test_the_gallery_has_one_file_per_bug() -> None:
    assert sorted(p.stem for p in ZOO.glob("*.py")) == sorted(DIAGNOSES)


@pytest.mark.parametrize("name", list(DIAGNOSES))
def test_each_bug_gets_its_diagnosis(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ZOO))  # the ranks inherit sys.path, so they can import it
    module = importlib.import_module(name)
    try:
        report = module.check(world_size=2)
    finally:
        sys.modules.pop(name, None)
    assert not report.ok
    assert any(DIAGNOSES[name] in d for d in report.diagnoses), report.diagnoses
    if name == "open_clip_616_all_gather":  # x W when summed: exact when averaged, as DDP does
        assert report.contracts == {"averaged": True, "summed": False}
