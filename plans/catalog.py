"""Built-in models and clusters, shipped as YAML under plans/catalog/.

Anywhere a catalog name is accepted, a path to a YAML or JSON file of the same schema works too.
"""

from __future__ import annotations

import difflib
import os
from functools import cache
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from plans import hf
from plans.errors import SpecError, describe
from plans.io import read_document
from plans.plan import Plan
from plans.specs import KERNEL_FACTORS, ClusterSpec, ModelSpec

CATALOG_DIR = Path(__file__).parent / "catalog"
T = TypeVar("T", bound=BaseModel)


KINDS: dict[str, type[BaseModel]] = {"model": ModelSpec, "cluster": ClusterSpec, "plan": Plan}


def _kind_of(data: dict) -> str | None:
    """Which document kind has every required field of `data` and no field it lacks."""
    keys = set(data)
    for name, spec in KINDS.items():
        required = {n for n, f in spec.model_fields.items() if f.is_required()}
        if required <= keys <= set(spec.model_fields):
            return name
    return None


def parse(kind: type[T], data: dict, where: str) -> T:
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        expected = next((n for n, k in KINDS.items() if k is kind), None)
        found = _kind_of(data)
        if expected and found and found != expected:
            raise SpecError(f"{where}: this is a {found} document, not a {expected}") from None
        raise SpecError(f"{where}: {describe(e)}") from None


def names(kind: str) -> list[str]:
    """Catalog names of one kind ("models", "clusters" or "efficiency" profiles)."""
    return sorted(p.stem for p in (CATALOG_DIR / kind).glob("*.yaml"))


def _path_shaped(text: str) -> bool:
    """A spec file rather than a catalog name: a spec suffix or a folder in it."""
    return Path(text).suffix in (".yaml", ".yml", ".json") or "/" in text or os.sep in text


PROFILE = "profile"
"""The key of a cluster's ``efficiency`` that names an efficiency profile of the catalog."""


def efficiency_profile(name: str, where: str) -> dict:
    """The factors of the catalog's efficiency profile ``name`` (plans/catalog/efficiency/):
    one definition of a set of kernel factors that several clusters share."""
    path = CATALOG_DIR / "efficiency" / f"{name}.yaml" if isinstance(name, str) else None
    if path is None or not name.strip() or "/" in name or not _exists(path):
        raise SpecError(f"{where}.efficiency.{PROFILE}: unknown efficiency profile {name!r}; "
                        f"built-in: {', '.join(names('efficiency'))}")
    data = read_document(path)
    if not isinstance(data, dict):
        raise SpecError(f"efficiency profile {name}: not a mapping of factors")
    return data


KERNEL_SCALE = "kernel_scale"
"""A key beside ``profile``: one factor on the profile's kernel rates (plans.specs.KERNEL_FACTORS),
for a system whose kernels run at another rate than the profile measured (its
``efficiency_source`` says what it is fitted to)."""


def _scaled(factors: dict, scale: object, where: str) -> dict:
    """A profile's factors with its kernel rates times ``scale`` (0 < scale <= 2)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale <= 2:
        raise SpecError(f"{where}.efficiency.{KERNEL_SCALE}: {scale!r} is not a number in "
                        "(0, 2]")
    return {k: v * scale if k in KERNEL_FACTORS and isinstance(v, int | float) else v
            for k, v in factors.items()}


def _with_profile(data: object, where: str) -> object:
    """A cluster document with its ``efficiency: {profile: NAME, ...}`` replaced by that
    profile's factors, times ``kernel_scale`` where given, the factors beside ``profile``
    overriding them."""
    if not isinstance(data, dict) or not isinstance(data.get("efficiency"), dict):
        return data
    eff = dict(data["efficiency"])
    if PROFILE not in eff:
        if KERNEL_SCALE in eff:
            raise SpecError(f"{where}.efficiency.{KERNEL_SCALE}: scales a profile's kernel "
                            f"rates; name the profile beside it ({PROFILE}: ...)")
        return data
    factors = efficiency_profile(eff.pop(PROFILE), where)
    if KERNEL_SCALE in eff:
        factors = _scaled(factors, eff.pop(KERNEL_SCALE), where)
    return {**data, "efficiency": {**factors, **eff}}


def _read_spec(spec: type[T], path: Path) -> T:
    """A spec file; for models also a Hugging Face config.json or a snapshot folder holding
    one (plans.hf)."""
    if spec is ModelSpec:
        if hf.config_path(path) is not None and path.is_dir():
            return hf.load(path)
        data = read_document(path)
        if hf.is_hf_config(data):
            return hf.to_spec(data, str(path), hf.model_name(path))
        return parse(spec, data, str(path))
    data = read_document(path)
    if spec is ClusterSpec:
        data = _with_profile(data, str(path))
    return parse(spec, data, str(path))


@cache
def _load(kind: str, name_or_path: str, spec: type[T], what: str) -> T:
    """A catalog name, or a path to a spec file. A catalog name wins over a file of the same
    name in the working directory (``h200`` is the cluster even beside a folder ``h200``);
    give ``./h200`` for the file. A blank name is a name (never the working directory).
    ``what`` names the argument in an unknown name's error."""
    path = Path(name_or_path)
    builtin = CATALOG_DIR / kind / f"{name_or_path.lower()}.yaml"
    if _path_shaped(name_or_path) or (name_or_path.strip() and not _exists(builtin)
                                      and _exists(path)):
        return _read_spec(spec, path)
    if not _exists(builtin):
        close = difflib.get_close_matches(name_or_path.lower(), names(kind), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SpecError(
            f"{what}: unknown name {name_or_path!r}; {hint}built-in {kind}: "
            f"{', '.join(names(kind))} (or give a path to a .yaml/.json file"
            f"{', a Hugging Face config.json or a snapshot folder' if kind == 'models' else ''})"
        )
    where = f"{kind[:-1]} {name_or_path}"
    data = read_document(builtin)
    if spec is ClusterSpec:
        data = _with_profile(data, where)
    return parse(spec, data, where)


def _exists(path: Path) -> bool:
    """Like Path.exists, but a name the OS refuses (too long, say) is just not a file."""
    try:
        return path.exists()
    except OSError:
        return False


def load_model(name_or_path: str) -> ModelSpec:
    return _load("models", name_or_path, ModelSpec, "model")


def load_cluster(name_or_path: str, gpus: int | None = None, what: str = "cluster"
                 ) -> ClusterSpec:
    """A cluster by name or path; ``gpus`` replaces the job size; ``what`` names the argument
    or option it came from in errors."""
    cluster = _load("clusters", name_or_path, ClusterSpec, what)
    return cluster if gpus is None else resize(cluster, gpus, "--gpus")


def resize(cluster: ClusterSpec, gpus: int, where: str) -> ClusterSpec:
    """The same cluster with another GPU count; errors name `where` (an option or field)."""
    try:
        return cluster.with_gpus(gpus)
    except ValidationError as e:
        raise SpecError(f"{where}: {describe(e)}") from None


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return parse(Plan, read_document(path), str(path))
