"""Every Diffusers pipeline built on a transformer diffusers-sp runs is compared with one process or
refused with a reason, and docs/pipelines.md (with the README's totals) is the registry's (diffusers_sp.coverage)."""

from __future__ import annotations

from pathlib import Path

import pytest

import families
from diffusers_sp import coverage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
    return coverage.coverage()


def test_every_pipeline_that_runs_is_compared_with_one_process(rows):
    tested = set(families.pipeline_cases()) | set(families.covered_elsewhere())
    untested = sorted(r.pipeline for r in rows if r.runs and r.pipeline not in tested)
    assert not untested, (f"pipelines marked as running without an equality test (add them to a module of "
                          f"tests/families/, or to diffusers_sp.coverage.REFUSED with a reason): {untested}")


def test_every_refusal_has_a_reason_and_a_test(rows):
    refused = {r.pipeline for r in rows if r.family is not None and not r.runs}
    assert refused == set(coverage.REFUSED) & {r.pipeline for r in rows}
    assert all(coverage.REFUSED[name].strip() for name in refused)
    missing = sorted(refused - set(families.refusal_cases()))
    assert not missing, f"refused pipelines without a refusal case in tests/families/: {missing}"


def test_configs_name_real_pipelines(rows):
    known = {r.pipeline for r in rows}
    for name in list(families.pipeline_cases()) + list(families.covered_elsewhere()) + list(families.refusal_cases()):
        assert name in known, f"tests/families/ configures {name}, which is not a pipeline on a transformer"


def test_pipelines_doc_and_readme_totals_are_the_registry(rows):
    doc = (ROOT / "docs" / "pipelines.md").read_text(encoding="utf-8")
    table = coverage.marked_section(doc, coverage.TABLE_BEGIN, coverage.TABLE_END)
    assert table == coverage.markdown_table(rows), "run `python -m diffusers_sp.coverage --write`"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    totals = coverage.marked_section(readme, coverage.TOTALS_BEGIN, coverage.TOTALS_END)
    assert totals == coverage.totals_line(rows), "run `python -m diffusers_sp.coverage --write`"


def test_json_lists_every_pipeline_with_its_status(rows):
    """``python -m diffusers_sp.coverage --json``: one entry per pipeline class (classic, then modular),
    runs and reason agreeing."""
    import json

    data = json.loads(coverage.as_json(rows))
    modular = coverage.modular_coverage()
    assert [d["pipeline"] for d in data] == [r.pipeline for r in rows] + [r.pipeline for r in modular]
    assert [d["modular"] for d in data] == [False] * len(rows) + [True] * len(modular)
    assert all(d["runs"] == (not d["reason"]) and (d["modes"] != []) == d["runs"] for d in data)
    assert sum(d["runs"] for d in data) == sum(r.runs for r in rows) + sum(r.runs for r in modular)


def test_modular_pipelines_listed_and_the_tested_ones_compared():
    """The modular pipelines are in the coverage (each accepted one with its family's modes); those
    marked tested are the ones tests/test_modular.py and the families' ``MODULAR`` cases compare with one
    process."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import cases_modular

    modular = {r.pipeline: r for r in coverage.modular_coverage()}
    assert "WanModularPipeline" in modular and modular["WanModularPipeline"].runs
    assert {name for name, r in modular.items() if r.tested} == set(coverage.MODULAR_TESTED)
    assert set(coverage.MODULAR_TESTED) == set(cases_modular.VARIANTS) | set(families.modular_cases())
    assert all(r.modes and r.family for r in modular.values() if r.runs)
    assert all(not r.modes and r.reason for r in modular.values() if not r.runs)


def test_every_refused_dit_has_a_model_specific_reason(rows):
    """No DiT pipeline, classic or modular, is refused with the generic "not parallelized yet": each transformer
    without a family has its reason in diffusers_sp.pipelines.refused, and each reason names a real class."""
    import diffusers

    from diffusers_sp.pipelines.refused import REFUSED_MODELS

    generic = sorted(r.pipeline for r in rows + coverage.modular_coverage() if "not parallelized yet" in r.reason)
    assert not generic, f"refused without a model-specific reason (add it to pipelines/refused.py): {generic}"
    unknown = sorted(name for name in REFUSED_MODELS if not hasattr(diffusers, name))
    assert not unknown, f"pipelines/refused.py names classes Diffusers does not have: {unknown}"


def test_refused_model_refused_with_its_reason():
    """enable_sequence_parallel on a pipeline holding a refused transformer, or on the transformer itself, raises
    before any collective with the model's reason (a stand-in class of the same name: the reason is found by
    name)."""
    from diffusers import DiffusionPipeline, ModelMixin

    from diffusers_sp import SequenceParallelConfigError
    from diffusers_sp.pipelines import resolve_target
    from diffusers_sp.pipelines.refused import REFUSED_MODELS

    model = type("SanaWMTransformer3DModel", (ModelMixin,), {})()

    class Pipe(DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    for target in (model, Pipe(model)):
        with pytest.raises(SequenceParallelConfigError) as err:
            resolve_target(target)
        assert REFUSED_MODELS["SanaWMTransformer3DModel"] in str(err.value), str(err.value)


def test_refused_denoiser_of_another_name_refused_with_its_reason():
    """A pipeline whose denoiser is not named ``transformer`` (LTX-2's ``diffusion_decoder``) is refused with
    that model's reason, naming the component (it said "a Diffusers pipeline without a transformer"); the
    real pipeline class is in the coverage, refused with the same reason."""
    from diffusers import DiffusionPipeline, ModelMixin

    from diffusers_sp import SequenceParallelConfigError
    from diffusers_sp.pipelines import resolve_target
    from diffusers_sp.pipelines.refused import REFUSED_MODELS

    reason = REFUSED_MODELS["LTX2VideoDiffusionDecoderModel"]
    decoder = type("LTX2VideoDiffusionDecoderModel", (ModelMixin,), {})()

    class Pipe(DiffusionPipeline):
        def __init__(self, diffusion_decoder):
            super().__init__()
            self.register_modules(diffusion_decoder=diffusion_decoder)

    with pytest.raises(SequenceParallelConfigError) as err:
        resolve_target(Pipe(decoder))
    assert "Pipe.diffusion_decoder is a LTX2VideoDiffusionDecoderModel" in str(err.value) and reason in str(err.value)
    row = {r.pipeline: r for r in coverage.coverage()}["LTX2VideoDiffusionDecodePipeline"]
    assert not row.runs and reason in row.reason and row.transformers == (("diffusion_decoder", "LTX2VideoDiffusionDecoderModel"),)
