"""Regressions: inputs that once crashed the CLI with a traceback or exited with a non-2 code."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from plans import ClusterSpec, catalog
from plans.errors import SpecError, describe

from .conftest import TINY_JOB, assert_one_line_error, run


@pytest.mark.parametrize("suffix", [".json", ".yaml", ""])
def test_non_utf8_file_is_one_line_error(tmp_path, suffix):
    # read_text() raised UnicodeDecodeError (a ValueError, not an OSError): traceback
    bad = tmp_path / f"bytes{suffix}"
    bad.write_bytes(b"\xff\xfe\x00\x81garbage")
    assert_one_line_error(run("validate", bad), str(bad), "UTF-8")
    assert_one_line_error(run("search", bad, "h100", "--gpus", "8"), str(bad), "UTF-8")


def test_overlong_catalog_name_is_unknown_name():
    # Path.exists() raised OSError(ENAMETOOLONG) for a 300-character name: traceback
    assert_one_line_error(run("search", "x" * 300, "h100", "--gpus", "8"), "unknown name")
    assert_one_line_error(run("search", "tiny-moe", "y" * 300, "--gpus", "8"), "unknown name")


@pytest.mark.parametrize("text", ["a: 2020-13-01\n", "a: " + "9" * 5000 + "\n"])
def test_yaml_value_errors_are_one_line(tmp_path, text):
    # PyYAML raises ValueError (bad date, int over the digit limit), not YAMLError: traceback
    bad = tmp_path / "model.yaml"
    bad.write_text(text)
    assert_one_line_error(run("search", bad, "h100", "--gpus", "8"), "not valid yaml")


def test_deeply_nested_json_is_one_line(tmp_path):
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(run("validate", bad), "not valid json")


@pytest.mark.parametrize("value", ["1e-320", "5e-324", "1e-9"])
def test_subnormal_hardware_value_is_out_of_range(value):
    # a GPU of 1e-320 TFLOP/s made stage times inf and their ratio nan: ValueError in the
    # stage split ("cannot convert float NaN to integer")
    result = run("whatif", *TINY_JOB, "--vary", f"gpu_tflops={value}")
    assert_one_line_error(result, "--vary gpu_tflops", "out of range")


@pytest.mark.parametrize("knob,value", [("hbm_gib", "inf"), ("network_gb_s", "1e400"),
                                        ("hbm_tb_s", "1e300"), ("nvlink_gb_s", "nan")])
def test_non_finite_or_huge_hardware_value_is_refused(knob, value):
    # inf was accepted and searched; nan said "greater than 0"
    assert_one_line_error(run("whatif", *TINY_JOB, "--vary", f"{knob}={value}"), knob)


@pytest.mark.parametrize("path,value", [
    (("gpu", "hbm_gib"), float("inf")),
    (("gpu", "bf16_dense_tflops"), 1e-320),
    (("efficiency", "gemm"), 1e-300),
    (("node", "nvlink_latency_us"), float("nan")),
])
def test_cluster_spec_rejects_non_finite_and_tiny(path, value):
    data = catalog.load_cluster("h100").model_dump()
    data[path[0]][path[1]] = value
    with pytest.raises(ValidationError) as e:
        ClusterSpec.model_validate(data)
    assert describe(e.value).startswith(".".join(path) + ":")


def test_cluster_file_with_yaml_inf_is_one_line(tmp_path):
    data = catalog.load_cluster("h100").model_dump(mode="json")
    data["gpu"]["hbm_gib"] = ".inf"
    text = json.dumps(data).replace('".inf"', ".inf")  # JSON is YAML; .inf is a YAML float
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        catalog.load_cluster(str(path))
    assert str(e.value).startswith(f"{path}: gpu.hbm_gib:")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("factor", [1e308, 1e6, 2.5])
def test_huge_capacity_factor_is_refused(tmp_path, plan_doc, factor):
    # capacity_factor 1e308 made the expert token count inf: OverflowError in validate/explain
    doc = json.loads(json.dumps(plan_doc))
    doc["ffn"] = {"kind": "ep", "capacity_factor": factor}  # tiny-moe: 4 experts, top-2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    for cmd in ("validate", "explain"):
        assert_one_line_error(run(cmd, path), "ffn.capacity_factor", "at most")


def test_capacity_factor_at_the_limit_is_accepted(tmp_path, plan_doc):
    doc = json.loads(json.dumps(plan_doc))
    doc["ffn"] = {"kind": "ep", "capacity_factor": 2.0}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert run("validate", path).exit_code == 0


@pytest.mark.parametrize("value", ["1e400", "inf", "-inf", "nan", "1e400x"])
def test_whatif_non_finite_vary_value(value):
    # found by tests/reliability/fuzz_cli.py: nvlink_domain=1e400 -> int(inf) raised OverflowError
    for knob in ("nvlink_domain", "hbm_gib"):
        line = assert_one_line_error(run("whatif", *TINY_JOB, "--vary", f"{knob}={value}"),
                                     f"--vary {knob}")
        assert "finite" in line or "out of range" in line
