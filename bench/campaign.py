"""Run one measurement campaign of bench/campaigns.yaml: the runner of every device call.

    python3 -m bench.campaign NAME [--only STEP ...] [--dry-run] [--manifest bench/campaigns.yaml]
    bash bench/run_campaign.sh NAME      # on a GPU machine: environment and wheels first

Each step runs under a timeout (its own, capped by what is left of the campaign's budget; a
step that cannot get 40 s is skipped), logs to <results>/<step>.log (the step's results folder:
its campaign's unless it names its own), and after every step the campaign's results folders
are packed into $OUT/results.tgz. A result a step wrote is read back as its typed
document (plans/results.py) and reported. --only runs the named steps of the campaign alone (to
remeasure a few results in one device call). --dry-run prints the commands and checks the
manifest (every plan exists and fits the campaign's GPUs) without running anything.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from bench.report import ROOT
from plans import SpecError
from plans.catalog import load_plan
from plans.errors import describe
from plans.results import ParityResult, ProfileResult, TrainStepResult, read

MANIFEST = ROOT / "bench" / "campaigns.yaml"
MIN_STEP_S = 40
"""A step that would get less than this is skipped rather than started."""


class _Step(BaseModel, ABC):
    model_config = ConfigDict(extra="forbid", frozen=True)
    RESULT: ClassVar[type[BaseModel] | None] = None
    """The typed document the step's result is read back as."""

    timeout_s: PositiveInt = 150
    results: str | None = None
    """The folder, relative to the repository root, of this step's log and result when not its
    campaign's: a merged campaign's step keeps the folder its readers cite."""

    def folder(self, campaign: Campaign) -> str:
        return self.results or campaign.results

    def plan_path(self) -> Path | None:
        return None

    @abstractmethod
    def ranks(self) -> int:
        """Processes the step launches."""

    def gpus_needed(self) -> int:
        return self.ranks()

    def output(self) -> str:
        """The result's file under the step's results folder."""
        return f"{self.name}.json"


class _PlanStep(_Step):
    kind_field: ClassVar[str]
    """The key that names the step's kind and holds its plan."""

    name_: str | None = Field(None, alias="name")
    """The step's name where the one its plan gives is another step's in the campaign."""

    def plan_path(self) -> Path:
        return Path(getattr(self, self.kind_field))

    @property
    def stem(self) -> str:
        return self.plan_path().stem

    @property
    def name(self) -> str:
        return self.name_ or self.default_name()

    def default_name(self) -> str:
        return f"{self.kind_field}_{self.stem}"

    def ranks(self) -> int:
        return load_plan(ROOT / self.plan_path()).degrees.world


class TrainStep(_PlanStep):
    kind_field: ClassVar[str] = "train_step"
    RESULT: ClassVar[type[BaseModel]] = TrainStepResult

    train_step: str
    steps: PositiveInt = 5
    warmup: int = Field(2, ge=0)
    launch: str | None = Field(None, pattern=r"^[a-z]$")
    """A further launch of the plan (step ``train_step_<plan>_<launch>``), its result in the
    folder ``launch_<launch>/``: a launch varies the step time, a report takes the median."""

    def default_name(self) -> str:
        return f"train_step_{self.stem}" + (f"_{self.launch}" if self.launch else "")

    def output(self) -> str:
        folder = f"launch_{self.launch}/" if self.launch else ""
        return f"{folder}train_step_{self.stem}.json"

    def command(self, results: Path) -> list[str]:
        return [*launcher(self.ranks()), "-m", "bench.steps.train_step", "--plan", self.train_step,
                "--steps", str(self.steps), "--warmup", str(self.warmup),
                "--out", str(results / self.output())]


class Parity(_PlanStep):
    kind_field: ClassVar[str] = "parity"
    RESULT: ClassVar[type[BaseModel]] = ParityResult

    parity: str
    share_gpu: bool = False
    """Every rank on the one GPU over gloo (the layout's numerics, never its speed)."""
    timeout_s: PositiveInt = 200

    def default_name(self) -> str:
        return f"parity_{'shared_' if self.share_gpu else ''}{self.stem}"

    def gpus_needed(self) -> int:
        return 1 if self.share_gpu else self.ranks()

    def command(self, results: Path) -> list[str]:
        return [*launcher(self.ranks(), force_torchrun=True), "-m", "runtime.parity",
                "--plan", self.parity, *(["--share-gpu"] if self.share_gpu else []),
                "--out", str(results / self.output()), "--force"]


class Profile(_PlanStep):
    kind_field: ClassVar[str] = "profile"
    RESULT: ClassVar[type[BaseModel]] = ProfileResult

    profile: str
    timeout_s: PositiveInt = 120

    def command(self, results: Path) -> list[str]:
        # --force: a campaign re-measures its committed results in place
        return [sys.executable, "-m", "runtime.profile", "--plan", self.profile,
                "--out", str(results / self.output()), "--force"]


class Script(_Step):
    script: str
    """The benchmark's module (``bench.layers.dispatch_gpu``, run as ``python -m``), or a Python
    file (a path ending in ``.py``, run as itself with the repository on ``PYTHONPATH``)."""
    name: str
    args: list[str] = []
    ranks_: PositiveInt = Field(1, alias="ranks")
    result: str
    """The file (under the step's results folder) the script writes."""
    needs: list[str] = []
    """Results files that must exist first; the step is skipped otherwise."""
    share_gpu: bool = False
    """Every rank on the one GPU (the script's ``--share-gpu``, which it is given): memory and
    numerics, never speed."""
    env: dict[str, str] = {}
    """Environment variables of this step alone (e.g. a collective library's switch whose
    effect the step measures); results record the NCCL ones (runtime.provenance)."""

    def ranks(self) -> int:
        return self.ranks_

    def gpus_needed(self) -> int:
        return 1 if self.share_gpu else self.ranks_

    def output(self) -> str:
        return self.result

    @property
    def is_file(self) -> bool:
        return self.script.endswith(".py")

    @property
    def module(self) -> str | None:
        return None if self.is_file else self.script

    def source(self) -> Path:
        """The file that runs (a module's under the repository)."""
        return ROOT / (self.script if self.is_file else
                       Path(*self.script.split(".")).with_suffix(".py"))

    def command(self, results: Path) -> list[str]:
        args = [a.replace("{results}", str(results)) for a in self.args]
        target = [self.script] if self.is_file else ["-m", self.script]
        return [*launcher(self.ranks_), *target, *args,
                *(["--share-gpu"] if self.share_gpu else [])]


def launcher(ranks: int, force_torchrun: bool = False) -> list[str]:
    """The one way a benchmark starts: plain python for one process, torchrun for more; a
    module follows as ``-m MODULE``."""
    if ranks == 1 and not force_torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks)]


STEP_KINDS = {"train_step": TrainStep, "parity": Parity, "profile": Profile, "script": Script}
"""A step's model, by the key that names its kind (a step's first key)."""


class Campaign(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    about: str
    gpus: PositiveInt
    """GPUs of the device call (the machine kind)."""
    results: str
    """Folder, relative to the repository root, of the logs and results."""
    budget_s: PositiveInt = 540
    """Wall-clock cap of the whole call (a device call may run 600 s)."""
    steps: list[TrainStep | Parity | Profile | Script] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _tag_steps(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("steps"), list):
            steps = []
            for i, s in enumerate(data["steps"]):
                kind = next((k for k in STEP_KINDS if isinstance(s, dict) and k in s), None)
                if kind is None:
                    raise ValueError(f"steps.{i}: needs one of {', '.join(STEP_KINDS)}")
                steps.append(STEP_KINDS[kind].model_validate(s))
            data = {**data, "steps": steps}
        return data

    @model_validator(mode="after")
    def _check(self) -> Campaign:
        names = [s.name for s in self.steps]
        if dup := next((n for n in names if names.count(n) > 1), None):
            raise ValueError(f"steps: two steps are named {dup!r} (give one a name)")
        outputs = [str(Path(s.folder(self)) / s.output()) for s in self.steps]
        if dup := next((o for o in outputs if outputs.count(o) > 1), None):
            raise ValueError(f"steps: two steps write {dup}")
        return self

    def folders(self) -> list[str]:
        """The folders its steps write, its own first."""
        return list(dict.fromkeys([self.results, *(s.folder(self) for s in self.steps)]))


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    campaigns: dict[str, Campaign]


def load_manifest(path: Path = MANIFEST) -> Manifest:
    try:
        return Manifest.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise SpecError(f"{path}: {describe(e)}") from None


def only(campaign: Campaign, names: list[str]) -> Campaign:
    """The campaign cut to the named steps, in the manifest's order."""
    have = [s.name for s in campaign.steps]
    if unknown := [n for n in names if n not in have]:
        # the closest names, not all of them: one short line at 80 columns
        close = difflib.get_close_matches(unknown[0], have, n=3, cutoff=0.3)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise SpecError(f"--only: no step {unknown[0]!r} in the campaign{hint} (all: "
                        f"--dry-run)")
    return campaign.model_copy(update={"steps": [s for s in campaign.steps if s.name in names]})


def check(campaign: Campaign) -> list[str]:
    """Problems that would fail a step before it measures anything: a missing plan or script,
    a step needing more GPUs than the campaign has."""
    problems = []
    for s in campaign.steps:
        plan = s.plan_path()
        if plan is not None and not (ROOT / plan).is_file():
            problems.append(f"{s.name}: plan {plan} does not exist")
            continue
        if isinstance(s, Script) and not s.source().is_file():
            problems.append(f"{s.name}: script {s.script} does not exist")
            continue
        if s.gpus_needed() > campaign.gpus:
            problems.append(f"{s.name}: needs {s.gpus_needed()} GPUs, the campaign has "
                            f"{campaign.gpus}")
    return problems


def _pack(folders: list[Path], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # a folder inside another of the campaign's goes in with it, once
    top = [f for f in folders if not any(f != g and f.is_relative_to(g) for g in folders)]
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        for f in top:
            tar.add(f, arcname=str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name))


def _report(step, result: Path) -> str:
    if step.RESULT is None or not result.exists():
        return "no result" if not result.exists() else "ok"
    try:
        doc = read(step.RESULT, result, step.name)
    except SpecError as e:
        return f"result does not parse: {e}"
    if isinstance(doc, TrainStepResult):
        return f"step {doc.step_time_s * 1e3:.1f} ms, MFU {doc.mfu:.1%}"
    if isinstance(doc, ParityResult):
        return "pass" if doc.passed else "FAIL"
    return "ok"


def _shown(step: _Step, results: Path) -> str:
    """A step's command as a shell line, its own environment variables first."""
    env = step.env if isinstance(step, Script) else {}
    return shlex.join([*(f"{k}={v}" for k, v in env.items()), *step.command(results)])


def run(name: str, campaign: Campaign, out: Path) -> int:
    folders = [ROOT / f for f in campaign.folders()]  # a relative folder is the repository's
    for f in folders:
        f.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)}
    start, failed = time.monotonic(), 0
    print(f"campaign {name}: {campaign.about} ({campaign.gpus} GPU(s), budget "
          f"{campaign.budget_s} s)", flush=True)
    for step in campaign.steps:
        left = campaign.budget_s - (time.monotonic() - start)
        if left < MIN_STEP_S:
            print(f"=== {step.name}: skipped ({left:.0f} s left)", flush=True)
            continue
        results = ROOT / step.folder(campaign)
        if isinstance(step, Script) and (missing := [n for n in step.needs
                                                     if not (results / n).exists()]):
            print(f"=== {step.name}: skipped (missing {', '.join(missing)})", flush=True)
            continue
        limit = min(step.timeout_s, left)
        cmd = step.command(results)
        print(f"=== {step.name} (timeout {limit:.0f} s): {_shown(step, results)}", flush=True)
        log = results / f"{step.name}.log"
        with log.open("w") as f:
            step_env = {**env, **step.env} if isinstance(step, Script) else env
            # a session of its own: on a timeout the whole group goes (torchrun's workers too,
            # which would otherwise keep their GPU memory through the next steps)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=step_env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        result = results / step.output()
        failed += rc != 0
        print(f"exit {rc}: {_report(step, result)}", flush=True)
        _pack(folders, out)
    print(f"done in {time.monotonic() - start:.0f} s, {failed} step(s) failed", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help="a campaign of the manifest")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--only", nargs="+", metavar="STEP",
                   help="run only these steps of the campaign (names as --dry-run prints them)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    try:
        manifest = load_manifest(args.manifest)
        if args.name not in manifest.campaigns:
            raise SpecError(f"campaign: {args.name!r} is not in {args.manifest} (have "
                            f"{', '.join(manifest.campaigns)})")
        campaign = manifest.campaigns[args.name]
        if args.only:
            campaign = only(campaign, args.only)
        if problems := check(campaign):
            raise SpecError(f"campaign {args.name}: {problems[0]}")
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for step in campaign.steps:
            print(f"{step.name}: {_shown(step, Path(step.folder(campaign)))}")
        return 0
    return run(args.name, campaign, Path(os.environ.get("OUT", "/tmp/out")))


if __name__ == "__main__":
    sys.exit(main())
