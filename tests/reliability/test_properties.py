"""Property tests of the specs and the Plan schema: valid documents parse and round-trip, every
mutation into an invalid one is refused with a one-line `field.path: reason` message."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from plans import ClusterSpec, Degrees, ModelSpec, Plan, SpecError, TrainingSpec, catalog
from plans.errors import describe

FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# ---- strategies of valid documents ------------------------------------------------------------


# names are printable (plans.specs.Name)
NAMES = st.text(st.characters(categories=("L", "N", "P", "S")), min_size=1, max_size=12)


@st.composite
def model_dicts(draw) -> dict:
    kv = draw(st.integers(1, 8))
    experts = draw(st.integers(1, 64))
    layers = draw(st.integers(1, 48))
    dense = draw(st.integers(0, layers - 1))
    shared = draw(st.integers(0, 2))
    return {
        "name": draw(NAMES),
        "layers": layers,
        "hidden": draw(st.integers(1, 8192)),
        "query_heads": kv * draw(st.integers(1, 8)),
        "kv_heads": kv,
        "head_dim": draw(st.sampled_from([8, 16, 64, 128])),
        "vocab": draw(st.integers(1, 200_000)),
        "expert_ffn_hidden": draw(st.integers(1, 16384)),
        "experts": experts,
        "top_k": draw(st.integers(1, experts)),
        "shared_experts": shared,
        "shared_expert_ffn_hidden": draw(st.integers(1, 4096)) if shared else 0,
        "dense_layers": dense,
        "dense_ffn_hidden": draw(st.integers(1, 16384)) if dense else 0,
        "tied_embeddings": draw(st.booleans()),
        "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 1e6])),
        "norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "qk_norm": draw(st.booleans()),
        "router_pre_softmax": draw(st.booleans()),
        "aux_loss_coeff": draw(st.sampled_from([0.0, 0.001, 0.01])),
        "dropout": 0.0,
    }


def _rate(lo=1e-3, hi=1e5):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


@st.composite
def cluster_dicts(draw) -> dict:
    per_node = draw(st.sampled_from([1, 2, 4, 8, 72]))
    gpus = draw(st.one_of(st.integers(1, per_node), st.integers(1, 16).map(lambda n: n * per_node)))
    return {
        "name": draw(NAMES),
        "gpu": {"name": "g", "bf16_dense_tflops": draw(_rate()), "fp8_dense_tflops": draw(_rate()),
                "hbm_gib": draw(_rate()), "hbm_tb_s": draw(_rate()),
                "sms": draw(st.integers(1, 200))},
        "node": {"gpus_per_node": per_node, "nvlink_gb_s": draw(_rate()),
                 "nvlink_latency_us": draw(_rate(0, 100))},
        "network": {"name": "n", "nics_per_node": draw(st.integers(1, 16)),
                    "nic_gb_s": draw(_rate()), "latency_us": draw(_rate(0, 100))},
        "gpus": gpus,
        "efficiency": {"gemm": draw(_rate(0.01, 1)), "memory_usable": draw(_rate(0.01, 1))},
    }


training_dicts = st.fixed_dictionaries({
    "global_batch": st.integers(1, 4096),
    "seq_len": st.integers(1, 65536),
    "precision": st.sampled_from(["bf16", "fp8"]),
    "optimizer": st.sampled_from(["adam", "sgd"]),
    "routing_skew": st.floats(1.0, 64.0, allow_nan=False),
    "memory_cap_gib": st.one_of(st.none(), st.floats(1.0, 1024.0, allow_nan=False)),
    # mxfp8 needs fp8 (plans.specs.TrainingSpec): the default recipe for every precision
    "fp8_recipe": st.just("tensorwise"),
})


@pytest.fixture(scope="module")
def catalog_plans(tmp_path_factory) -> list[dict]:
    """Valid plans of the tiny models from the search (several layouts)."""
    from planner.search import search

    docs = []
    for model, gpus in (("tiny-moe", 8), ("tiny-moe-shared", 4), ("tiny-moe", 2)):
        result = search(catalog.load_model(model), catalog.load_cluster("h100", gpus=gpus),
                        TrainingSpec(global_batch=16, seq_len=256), top=3)
        docs += [r.plan.model_dump(mode="json") for r in result.top]
        docs.append(result.baseline.plan.model_dump(mode="json")) if result.baseline else None
    assert len(docs) >= 6
    return docs


# ---- valid documents parse and round-trip -------------------------------------------------------


@FAST
@given(model_dicts())
def test_valid_model_round_trips(data):
    model = ModelSpec.model_validate(data)
    assert ModelSpec.model_validate_json(model.model_dump_json()) == model
    dumped = json.loads(model.model_dump_json())
    assert {k: dumped[k] for k in data} == data  # the fields not drawn keep their defaults
    assert ModelSpec.model_validate({k: v for k, v in dumped.items() if k in data}) == model


@FAST
@given(cluster_dicts())
def test_valid_cluster_round_trips(data):
    cluster = ClusterSpec.model_validate(data)
    again = ClusterSpec.model_validate_json(cluster.model_dump_json())
    assert again == cluster
    assert again.nvlink_domain == min(cluster.gpus, data["node"]["gpus_per_node"])


@FAST
@given(training_dicts)
def test_valid_training_round_trips(data):
    training = TrainingSpec.model_validate(data)
    assert json.loads(training.model_dump_json()) == data
    assert training.tokens_per_step == data["global_batch"] * data["seq_len"]


@FAST
@given(st.data())
def test_valid_plans_round_trip(catalog_plans, data):
    doc = data.draw(st.sampled_from(catalog_plans))
    plan = Plan.model_validate(doc)
    text = plan.model_dump_json()
    assert Plan.model_validate_json(text) == plan
    assert json.loads(text) == doc


# ---- properties of valid specs -----------------------------------------------------------------


@FAST
@given(model_dicts(), st.integers(1, 65536), st.integers(1, 65536))
def test_parameter_counts_and_flops(data, s1, s2):
    m = ModelSpec.model_validate(data)
    assert m.total_params >= m.active_params > 0
    assert (m.total_params == m.active_params) == (m.top_k == m.experts)
    lo, hi = sorted((s1, s2))
    assert m.flops_per_token(lo) <= m.flops_per_token(hi)
    if lo < hi:
        assert m.flops_per_token(lo) < m.flops_per_token(hi)
    assert m.flops_per_token(lo, training=True) == pytest.approx(3 * m.flops_per_token(lo, False))


axis = st.integers(1, 8)


@FAST
@given(axis, axis, axis, axis, axis, axis, axis)
def test_degrees_invariants(pp, dp, cp, sp, tp, ep, etp):
    inner = dp * cp * sp * tp
    fields = dict(pp=pp, dp=dp, cp=cp, sp=sp, tp=tp, ep=ep, etp=etp)
    if inner % (ep * etp):
        with pytest.raises(ValidationError) as e:
            Degrees(**fields)
        assert "\n" not in describe(e.value) and "ep x etp" in describe(e.value)
        return
    d = Degrees(**fields)
    assert d.world == pp * dp * cp * sp * tp
    assert d.edp * d.ep * d.etp == inner
    assert d.world == d.pp * d.edp * d.ep * d.etp


# ---- invalid documents: mutations -------------------------------------------------------------

FIELD_PATH = re.compile(r"[a-z_][a-z_0-9]*(\.[a-z_0-9]+)*")


def check_message(err: ValidationError, first_field: str | None = None) -> str:
    """One line that starts with a field path: `a.b: reason` for a field's own error, or
    `field (value) must ...` for a check across fields."""
    text = describe(err)
    assert text and "\n" not in text and text.strip() == text
    match = FIELD_PATH.match(text)
    assert match and text[match.end():match.end() + 1] in (":", " "), text
    head = match.group()
    if first_field is not None:
        assert head == first_field or head.startswith(first_field + "."), (first_field, text)
    return text


def _set(doc: dict, path: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def _drop(doc: dict, path: tuple) -> dict:
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return doc


REQUIRED_MODEL = ["name", "layers", "hidden", "query_heads", "kv_heads", "head_dim", "vocab",
                  "expert_ffn_hidden", "experts", "top_k"]
POSITIVE_MODEL = [f for f in REQUIRED_MODEL if f != "name"]


@FAST
@given(model_dicts(), st.data())
def test_model_mutations_are_refused(data, draw):
    kind = draw.draw(st.sampled_from(["drop", "type", "nonpositive", "heads", "top_k",
                                      "unknown", "float"]))
    if kind == "drop":
        field = draw.draw(st.sampled_from(REQUIRED_MODEL))
        bad, where = _drop(data, (field,)), field
    elif kind == "type":
        field = draw.draw(st.sampled_from(POSITIVE_MODEL))
        bad, where = _set(data, (field,), draw.draw(st.sampled_from(["many", None, [], {}]))), field
    elif kind == "nonpositive":
        field = draw.draw(st.sampled_from(POSITIVE_MODEL))
        bad, where = _set(data, (field,), draw.draw(st.integers(-10**6, 0))), field
    elif kind == "heads":
        assume(data["kv_heads"] > 1)
        bad = _set(data, ("query_heads",), data["kv_heads"] * 3 + 1)
        where = None
    elif kind == "top_k":
        bad = _set(data, ("top_k",), data["experts"] + draw.draw(st.integers(1, 10)))
        where = None
    elif kind == "unknown":
        bad, where = _set(data, ("expert_count",), 8), "expert_count"
    else:
        field = draw.draw(st.sampled_from(POSITIVE_MODEL))
        bad, where = _set(data, (field,), data[field] + 0.5), field
    with pytest.raises(ValidationError) as e:
        ModelSpec.model_validate(bad)
    text = check_message(e.value, where)
    if kind == "heads":
        assert "query_heads" in text and "kv_heads" in text
    if kind == "top_k":
        assert "top_k" in text and "experts" in text


CLUSTER_FLOATS = [("gpu", "bf16_dense_tflops"), ("gpu", "hbm_gib"), ("gpu", "hbm_tb_s"),
                  ("node", "nvlink_gb_s"), ("network", "nic_gb_s"), ("efficiency", "gemm")]


@FAST
@given(cluster_dicts(), st.data())
def test_cluster_mutations_are_refused(data, draw):
    kind = draw.draw(st.sampled_from(["float", "gpus", "drop", "unknown", "world"]))
    if kind == "float":
        path = draw.draw(st.sampled_from(CLUSTER_FLOATS))
        value = draw.draw(st.sampled_from([0.0, -1.0, math.inf, math.nan, 1e-320, 1e300, "x"]))
        bad, where = _set(data, path, value), ".".join(path)
    elif kind == "gpus":
        bad, where = _set(data, ("gpus",), draw.draw(st.integers(-5, 0))), "gpus"
    elif kind == "drop":
        path = draw.draw(st.sampled_from([("gpu",), ("node", "gpus_per_node"), ("gpus",),
                                          ("gpu", "hbm_gib"), ("network", "name")]))
        bad, where = _drop(data, path), ".".join(path)
    elif kind == "unknown":
        bad, where = _set(data, ("node", "nvswitch"), True), "node.nvswitch"
    else:  # a GPU count no node layout can hold
        per_node = data["node"]["gpus_per_node"]
        assume(per_node > 1)
        bad, where = _set(data, ("gpus",), per_node * 2 + 1), None
    with pytest.raises(ValidationError) as e:
        ClusterSpec.model_validate(bad)
    text = check_message(e.value, where)
    if kind == "world":
        assert "multiple of node.gpus_per_node" in text


@FAST
@given(training_dicts, st.sampled_from(["global_batch", "seq_len"]), st.integers(-100, 0))
def test_training_mutations_are_refused(data, field, value):
    with pytest.raises(ValidationError) as e:
        TrainingSpec.model_validate({**data, field: value})
    check_message(e.value, field)
    with pytest.raises(ValidationError) as e:
        TrainingSpec.model_validate({**data, "precision": "fp32"})
    assert "precision" in check_message(e.value)


PLAN_MUTATIONS = ["version", "world", "stages_sum", "stages_len", "heads", "top_k", "zero",
                  "unknown", "drop", "attention_kind", "micro_batch", "wrong_type"]


@FAST
@given(st.data())
def test_plan_mutations_are_refused(catalog_plans, data):
    doc = data.draw(st.sampled_from(catalog_plans))
    kind = data.draw(st.sampled_from(PLAN_MUTATIONS))
    words: list[str] = []
    if kind == "version":
        version = data.draw(st.sampled_from([0, 2, 7, "1", None]))
        bad, where = _set(doc, ("schema_version",), version), "schema_version"
        words = ["schema_version 1", repr(version)]
    elif kind == "world":
        bad, where = _set(doc, ("degrees", "pp"), doc["degrees"]["pp"] * 2), None
        words = ["cluster.gpus"]
    elif kind == "stages_sum":
        stages = list(doc["stage_layers"])
        stages[0] += data.draw(st.integers(1, 5))
        bad, where, words = _set(doc, ("stage_layers",), stages), None, ["stage_layers", "sum"]
    elif kind == "stages_len":
        bad = _set(doc, ("stage_layers",), [*doc["stage_layers"], 0])
        where, words = None, ["stage_layers", "entries"]
    elif kind == "heads":
        bad, where = _set(doc, ("model", "kv_heads"), 3), "model"
        words = ["query_heads", "kv_heads"]
    elif kind == "top_k":
        bad, where = _set(doc, ("model", "top_k"), doc["model"]["experts"] + 1), "model"
        words = ["top_k"]
    elif kind == "zero":
        path = data.draw(st.sampled_from([("model", "hidden"), ("training", "seq_len"),
                                          ("cluster", "gpus"), ("micro_batch_size",),
                                          ("degrees", "dp")]))
        bad, where = _set(doc, path, data.draw(st.integers(-3, 0))), ".".join(path)
    elif kind == "unknown":
        bad, where = _set(doc, ("degrees", "zz"), 2), "degrees.zz"
    elif kind == "drop":
        field = data.draw(st.sampled_from(["model", "cluster", "training", "degrees",
                                           "stage_layers"]))
        bad, where = _drop(doc, (field,)), field
    elif kind == "attention_kind":
        bad, where = _set(doc, ("attention",), {"kind": "ring"}), "attention"
    elif kind == "micro_batch":
        bad = _set(doc, ("micro_batch_size",), doc["training"]["global_batch"] + 1)
        where, words = None, ["micro_batch_size"]
    else:
        path = data.draw(st.sampled_from([("degrees", "tp"), ("training", "global_batch"),
                                          ("model", "experts")]))
        bad, where = _set(doc, path, "lots"), ".".join(path)
    with pytest.raises(ValidationError) as e:
        Plan.model_validate(bad)
    text = check_message(e.value, where)
    for w in words:
        assert w in text, (w, text)


# ---- through the loaders: files -----------------------------------------------------------------


@FAST
@given(st.data())
def test_bad_files_raise_one_line_spec_errors(tmp_path_factory, catalog_plans, data):
    doc = data.draw(st.sampled_from(catalog_plans))
    form = data.draw(st.sampled_from(["truncated", "bytes", "version", "list", "yaml_bad"]))
    directory = tmp_path_factory.mktemp("files")
    suffix = data.draw(st.sampled_from([".json", ".yaml"]))
    path = directory / f"plan{suffix}"
    full = json.dumps(doc)
    if form == "truncated":
        path.write_text(full[: data.draw(st.integers(0, len(full) - 1))])
    elif form == "bytes":
        path.write_bytes(data.draw(st.binary(min_size=1, max_size=64)))
    elif form == "version":
        path.write_text(json.dumps({**doc, "schema_version": 2}))
    elif form == "list":
        path.write_text(json.dumps([doc]))
    else:
        path.write_text("model: {layers: [\n")
    try:
        catalog.load_plan(path)
    except SpecError as e:
        text = str(e)
    else:  # a few truncations / byte strings are still valid YAML mappings... never a Plan
        raise AssertionError(f"{form} loaded")
    assert "\n" not in text and text.startswith(f"{path}: "), text
    if form == "version":
        assert "schema_version 1" in text and "has 2" in text

    for loader, kind in ((catalog.load_model, "model"), (catalog.load_cluster, "cluster")):
        spec_path = directory / f"{kind}{suffix}"
        spec_path.write_text(full[: len(full) // 2] if form == "truncated" else json.dumps(doc))
        with pytest.raises(SpecError) as e:
            loader(str(spec_path))
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{spec_path}: ")


@FAST
@given(st.text(min_size=1, max_size=40).filter(lambda s: "/" not in s and "\x00" not in s))
def test_unknown_catalog_names_list_the_choices(name):
    assume(name.lower() not in catalog.names("models") + catalog.names("clusters"))
    assume(not name.endswith((".yaml", ".yml", ".json")) and not Path(name).exists())
    for loader, kind, example in ((catalog.load_model, "model", "tiny-moe"),
                                  (catalog.load_cluster, "cluster", "h100")):
        with pytest.raises(SpecError) as e:
            loader(name)
        text = str(e.value)
        assert "\n" not in text
        assert text.startswith(f"{kind}: unknown name {name!r}") and example in text
