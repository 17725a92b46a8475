"""Fuzz the `moeplan` CLI in-process: generated argument lists and input files for every command.

Each case runs under typer's CliRunner with a per-case deadline (SIGALRM) and is classified:

- ok:          exit 0, no exception
- error_line:  exit 2, exactly one non-empty output line starting with `error: `, no traceback
- bad_error:   exit 2 but not exactly one `error: ` line
- other_exit:  any other exit status (and no uncaught exception)
- traceback:   an uncaught exception escaped the command
- hang:        the case passed its deadline
- wrote:       a failing case created or changed a file (`--out`, `--plot`), or `train` launched

Zero tracebacks, hangs, bad errors and writes is the target. `train` gets only cases that must
fail before launching (its launcher is replaced by one that records the launch), and so does
`profile`.

    python -m tests.reliability.fuzz_cli [--cases 10000] [--seed 0] [--timeout 20]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from typer.testing import CliRunner

from bench._meta import write
from planner import launch
from planner.cli import app
from planner.whatif import Knob
from plans import SpecError, catalog

ROOT = Path(__file__).resolve().parents[2]

MODELS = ["tiny-moe", "tiny-moe-shared"]
RESULTS = ROOT / "bench" / "results"
PROFILE = RESULTS / "h200" / "profile_mixtral2l_1gpu.json"
SWEEP = RESULTS / "calibration_h200.json"
GPU_PLANS = ROOT / "bench" / "gpu_plans"
CLUSTERS = ["h100", "h200", "a100", "b200"]
BAD_NAMES = ["", "tiny", "TINY-MOE", "h999", "mixtral", "../models/tiny-moe", "x" * 300,
             "tiny-moe.yaml", "-", "nul\x01name", "h100 ", "ümlaut"]
GPUS = ["1", "2", "4", "8", "3", "6", "16", "0", "-1", "12", "1024", "two", "", "1.5", "8e0"]
BATCHES = ["1", "2", "8", "16", "32", "3", "0", "-4", "x", "1000000007"]
SEQS = ["64", "128", "256", "512", "7", "0", "-1", "abc", "100000000000"]
FUZZ_VALUES = [0, -1, 1, 2, 3, 7, 10**9, 10**30, 2**63, 1e-320, 1e308, -0.5, 0.5, 1.5, "x", "",
               None, True, False, [], {}, [1, 2], "1", float("inf"), float("nan"), "Infinity"]
KNOBS = [k.value for k in Knob]
KNOB_VALUES = ["2x", "0.5x", "1", "900", "8", "16", "3", "0", "-1", "x", "2xx", "", "nan", "inf",
               "1e-320", "1e400", "1e30", "72", "0.0001x", "1e9", "1e-6"]


class Hang(BaseException):
    """Raised by SIGALRM when a case passes its deadline (BaseException: no handler eats it)."""


class Launched(BaseException):
    """Raised instead of starting torchrun."""


class Escaped:
    """What CliRunner would have returned had it caught a Hang or Launched."""

    def __init__(self, exc: BaseException):
        self.exception, self.exit_code, self.output = exc, None, ""


def _alarm(signum, frame):
    raise Hang()


# ---- generated inputs -------------------------------------------------------------------------


class Inputs:
    def __init__(self, rng: random.Random, workdir: Path, plans: list[dict]):
        self.rng = rng
        self.dir = workdir
        self.plans = plans
        self.n = 0

    def path(self, suffix: str) -> Path:
        self.n += 1  # a fresh name every time: the catalog caches loads by path
        return self.dir / f"f{self.n}{suffix}"

    def mutate(self, doc: dict) -> tuple[dict, str]:
        """A deep copy with one mutation, and its name."""
        rng = self.rng
        doc = json.loads(json.dumps(doc))
        kind = rng.choice(["leaf", "leaf", "leaf", "drop", "unknown", "none"])
        leaves = list(_leaves(doc))
        if kind == "none" or not leaves:
            return doc, "none"
        path = rng.choice(leaves)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if kind == "leaf":
            parent[path[-1]] = rng.choice(FUZZ_VALUES)
        elif kind == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        elif kind == "unknown" and isinstance(parent, dict):
            parent["bogus_field"] = 1
        return doc, f"{kind}:{'.'.join(map(str, path))}"

    def document_file(self, doc: dict) -> tuple[str, str]:
        """Write a (possibly mutated) document as JSON, YAML, truncated text or bytes."""
        rng = self.rng
        doc, what = self.mutate(doc) if rng.random() < 0.8 else (doc, "none")
        form = rng.choice(["json", "json", "yaml", "yaml", "truncated", "bytes", "list", "empty"])
        text: str | bytes
        if form == "json":
            suffix, text = ".json", json.dumps(doc)
        elif form == "yaml":
            suffix, text = rng.choice([".yaml", ".yml", ""]), yaml.safe_dump(doc)
        elif form == "truncated":
            full = json.dumps(doc)
            suffix, text = rng.choice([".json", ".yaml"]), full[: rng.randrange(len(full))]
        elif form == "bytes":
            suffix, text = rng.choice([".json", ".yaml"]), rng.randbytes(rng.randrange(1, 64))
        elif form == "list":
            suffix, text = ".json", json.dumps([doc])
        else:
            suffix, text = rng.choice([".json", ".yaml"]), ""
        path = self.path(suffix)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return str(path), f"{form}/{what}"

    def model(self) -> tuple[str, str]:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(MODELS), "catalog"
        if r < 0.85:
            return self.rng.choice(BAD_NAMES), "bad-name"
        name = self.rng.choice(MODELS)
        return self.document_file(catalog.load_model(name).model_dump(mode="json"))

    def cluster(self) -> tuple[str, str]:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(CLUSTERS), "catalog"
        if r < 0.85:
            return self.rng.choice(BAD_NAMES), "bad-name"
        name = self.rng.choice(CLUSTERS)
        return self.document_file(catalog.load_cluster(name).model_dump(mode="json"))

    def plan(self) -> tuple[str, str]:
        rng = self.rng
        doc = rng.choice(self.plans)
        r = rng.random()
        if r < 0.1:
            return str(self.dir / "missing.json"), "missing"
        if r < 0.15:
            return str(self.dir), "directory"
        if r < 0.3:  # a targeted inconsistency
            doc = json.loads(json.dumps(doc))
            what = rng.choice(["version", "world", "stages", "heads", "topk", "zero", "kind"])
            if what == "version":
                doc["schema_version"] = rng.choice([0, 2, "1", None, 1.5])
            elif what == "world":
                doc["degrees"]["dp"] = doc["degrees"]["dp"] * 2
            elif what == "stages":
                doc["stage_layers"] = [*doc["stage_layers"], 1]
            elif what == "heads":
                doc["model"]["kv_heads"] = 3
            elif what == "topk":
                doc["model"]["top_k"] = doc["model"]["experts"] + 1
            elif what == "zero":
                doc["training"]["global_batch"] = 0
            else:
                doc["attention"] = {"kind": "ring"}
            path = self.path(".json")
            path.write_text(json.dumps(doc))
            return str(path), f"targeted/{what}"
        return self.document_file(doc)


class Results:
    """Benchmark result files for `calibrate`, as committed or mutated."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self.profile_doc = json.loads(PROFILE.read_text())
        self.sweep_doc = json.loads(SWEEP.read_text())
        self.step_doc = json.loads((RESULTS / "h200" / "train_step_mixtral2l_1gpu.json")
                                   .read_text())

    def _doc(self, committed: Path, doc: dict) -> tuple[str, str]:
        rng, inputs = self.inputs.rng, self.inputs
        r = rng.random()
        if r < 0.5:
            return str(committed), "committed"
        if r < 0.6:
            return str(inputs.dir / "missing.json"), "missing"
        if r < 0.65:
            return str(inputs.dir), "directory"
        return inputs.document_file(doc)

    def profile(self) -> tuple[str, str]:
        return self._doc(PROFILE, self.profile_doc)

    def sweep(self) -> tuple[str, str]:
        return self._doc(SWEEP, self.sweep_doc)

    def runs(self) -> tuple[str, str]:
        rng, inputs = self.inputs.rng, self.inputs
        r = rng.random()
        if r < 0.5:
            return str(RESULTS / "h200"), "committed"
        if r < 0.6:
            return str(inputs.dir / "nowhere"), "missing"
        if r < 0.7:
            return str(PROFILE), "file"
        # a folder with one (possibly broken) measured step of a committed plan
        folder = inputs.path("")
        folder.mkdir()
        path, what = inputs.document_file(self.step_doc)
        Path(path).rename(folder / "train_step_mixtral2l_1gpu.json")
        return str(folder), f"one step {what}"


def _calibrate_case(rng: random.Random, inputs: Inputs, results: Results
                    ) -> tuple[list[str], str, Path]:
    profile, pw = results.profile()
    r = rng.random()
    if r < 0.7:
        plan, plw = str(GPU_PLANS / "mixtral2l_1gpu.json"), "1-GPU plan"
    elif r < 0.85:
        plan, plw = str(GPU_PLANS / "mixtral2l_sp2_ep2_a2a.json"), "2-GPU plan"
    else:
        plan, plw = inputs.plan()
    argv = ["calibrate", profile, "--plan", plan]
    what = [f"profile {pw}", f"plan {plw}"]
    if rng.random() < 0.25:
        sweep, sw = results.sweep()
        argv += ["--collectives", sweep]
        what.append(f"collectives {sw}")
    if rng.random() < 0.2:
        base, bw = inputs.cluster()
        argv += ["--base", base]
        what.append(f"base {bw}")
    if rng.random() < 0.1:
        argv += ["--name", rng.choice(["", "x" * 300, "my-h200", " "])]
    if rng.random() < 0.3:
        runs, rw = results.runs()
        argv += ["--runs", runs]
        what.append(f"runs {rw}")
    if rng.random() < 0.3:
        argv.append("--json")
    watch = inputs.path(".yaml")
    if rng.random() < 0.3:
        watch.write_text("precious\n")
        if rng.random() < 0.5:
            argv.append("--force")
    argv += ["--out", str(watch)]
    return argv, "; ".join(what), watch


def _leaves(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _leaves(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix + (i,)
            yield from _leaves(v, prefix + (i,))


# ---- argument lists per command ---------------------------------------------------------------


def _job_options(rng: random.Random, gpus: bool = True) -> list[str]:
    valid = rng.random() < 0.85
    args = []
    if gpus and (rng.random() < 0.95):
        args += ["--gpus", rng.choice(GPUS[:5] if valid else GPUS)]
    if rng.random() < 0.9:
        args += ["--global-batch", rng.choice(BATCHES[:5] if valid else BATCHES)]
    if rng.random() < 0.9:
        args += ["--seq-len", rng.choice(SEQS[:4] if valid else SEQS)]
    else:  # default seq len 8192 is fine for tiny models but keep the batch small
        args += ["--global-batch", "8"]
    if rng.random() < 0.2:
        args += ["--precision", rng.choice(["bf16", "fp8", "fp32", "fp16"])]
    return args


def case(rng: random.Random, inputs: Inputs, results: Results
         ) -> tuple[str, list[str], str, Path | None]:
    """(command, argv, what the inputs were, an output path to watch)."""
    cmd = rng.choices(["search", "explain", "validate", "export", "whatif", "scale", "train",
                       "calibrate", "profile", "misc"],
                      weights=[20, 12, 16, 12, 8, 8, 10, 8, 4, 4])[0]
    watch = None
    if cmd == "profile":
        return ("profile", *_profile_case(rng, inputs))
    if cmd == "calibrate":
        return ("calibrate", *_calibrate_case(rng, inputs, results))
    if cmd == "search":
        (model, mw), (cluster, cw) = inputs.model(), inputs.cluster()
        argv = ["search", model, cluster, *_job_options(rng)]
        if rng.random() < 0.8:
            argv += ["--top", rng.choice(["1", "2", "3", "0", "-2", "x"])]
        if rng.random() < 0.2:
            argv += ["--overlap", rng.choice(["none", "inter_op", "inter_intra_op", "bogus"])]
        if rng.random() < 0.2:
            argv += ["--recompute", rng.choice(["none", "selective", "full", "half"])]
        if rng.random() < 0.2:
            argv.append("--runnable")
        if rng.random() < 0.5:
            argv.append("--json")
        if rng.random() < 0.5:
            watch = inputs.path(".json")
            if rng.random() < 0.3:
                watch.write_text("precious\n")
                if rng.random() < 0.5:
                    argv.append("--force")
            argv += ["--out", str(watch)]
        return cmd, argv, f"model {mw}; cluster {cw}", watch
    if cmd in ("explain", "validate"):
        plan, what = inputs.plan()
        argv = [cmd, plan] + (["--json"] if cmd == "explain" and rng.random() < 0.5 else [])
        return cmd, argv, what, None
    if cmd == "export":
        plan, what = inputs.plan()
        argv = ["export", plan, "--to", rng.choice(["megatron", "torchrun", "slurm", "deepspeed",
                                                    ""])]
        if rng.random() < 0.3:
            argv += ["--steps", rng.choice(["1", "100", "0", "-3", "x"])]
        return cmd, argv, what, None
    if cmd == "whatif":
        (model, mw), (cluster, cw) = inputs.model(), inputs.cluster()
        argv = ["whatif", model, cluster, *_job_options(rng)]
        for _ in range(rng.choice([0, 1, 1, 2])):
            knob = rng.choice([*KNOBS, "bogus", ""])
            values = ",".join(rng.choice(KNOB_VALUES) for _ in range(rng.choice([1, 2])))
            argv += ["--vary", rng.choice([f"{knob}={values}", knob, f"={values}"])]
        if rng.random() < 0.5:
            argv.append("--json")
        if rng.random() < 0.15:
            watch = inputs.path(rng.choice([".txt", ".bogus"]))  # refused before any search
            argv += ["--plot", str(watch)]
        return cmd, argv, f"model {mw}; cluster {cw}", watch
    if cmd == "scale":
        (model, mw), (cluster, cw) = inputs.model(), inputs.cluster()
        counts = ",".join(rng.choice(GPUS[:5]) for _ in range(rng.choice([1, 2, 3])))
        argv = ["scale", model, cluster, "--gpus", rng.choice(
            [counts, counts, "0", "1,-2", "x", "", " , ", "3,8", "1e3"])]
        argv += _job_options(rng, gpus=False)
        if rng.random() < 0.3:
            argv += ["--weak", rng.choice(["1", "2", "0", "-1", "x"])]
        if rng.random() < 0.5:
            argv.append("--json")
        return cmd, argv, f"model {mw}; cluster {cw}", None
    if cmd == "train":
        return ("train", *_train_case(rng, inputs), None)
    argv = rng.choice([["catalog"], ["catalog", "--json"], ["schema"],
                       ["serach"], ["search"], ["catalog", "--bogus"], ["schema", "extra"],
                       ["validate"], ["export", inputs.plans and str(inputs.dir / "p0.json")],
                       ["whatif", "tiny-moe", "h100", "--gpus", "8"], ["--version"]])
    return "misc", argv, "usage", None


def _profile_case(rng: random.Random, inputs: Inputs) -> tuple[list[str], str, Path]:
    """Arguments that must make `profile` fail before it launches anything."""
    out = inputs.path(".json")
    what = rng.choice(["plan", "world", "exists", "steps"])
    if what == "plan":
        while True:  # only invalid plans: a valid 1-GPU plan would launch
            plan, desc = inputs.plan()
            try:
                catalog.load_plan(plan)
            except SpecError:
                break
        return ["profile", plan, "--out", str(out)], f"plan {desc}", out
    if what == "world":
        return ["profile", str(GPU_PLANS / "mixtral2l_sp2_ep2_a2a.json"), "--out", str(out)], \
            what, out
    if what == "exists":
        out.write_text("precious\n")
        return ["profile", str(GPU_PLANS / "mixtral2l_1gpu.json"), "--out", str(out)], what, out
    return ["profile", str(GPU_PLANS / "mixtral2l_1gpu.json"), "--out", str(out), "--steps",
            rng.choice(["0", "-1", "x"])], what, out


def _train_case(rng: random.Random, inputs: Inputs) -> tuple[list[str], str]:
    """Arguments that must make `train` fail before it launches anything."""
    good = str(inputs.dir / "p0.json")
    world = inputs.plans[0]["degrees"]
    world = world["pp"] * world["dp"] * world["cp"] * world["sp"] * world["tp"]
    what = rng.choice(["plan", "plan", "nproc", "data", "suffix", "resume", "ckpt_every",
                       "ckpt_dir", "steps", "option"])
    if what == "plan":
        while True:  # a mutation may leave the plan valid, and a valid plan would launch
            plan, desc = inputs.plan()
            try:
                catalog.load_plan(plan)
            except SpecError:
                break
        return ["train", plan, "--steps", "1"], f"plan {desc}"
    if what == "nproc":
        return ["train", good, "--nproc-per-node", str(world * rng.choice([2, 3]))], what
    if what == "data":
        return ["train", good, "--data", str(inputs.path(".u16"))], what
    if what == "suffix":
        data = inputs.path(rng.choice([".bin", ".txt", ""]))
        data.write_bytes(b"\0" * 32)
        return ["train", good, "--data", str(data)], what
    if what == "resume":
        return ["train", good, "--resume"], what
    if what == "ckpt_every":
        return ["train", good, "--ckpt-every", "2"], what
    if what == "ckpt_dir":
        return ["train", good, "--ckpt-dir", good], what
    if what == "steps":
        return ["train", good, "--steps", rng.choice(["0", "-1", "x"])], what
    return ["train", good, rng.choice(["--bogus", "--nproc-per-node"])], what


# ---- running and classifying ----------------------------------------------------------------


def classify(result, launched: bool, changed: bool) -> str:
    exc = result.exception
    if isinstance(exc, Hang):
        return "hang"
    if exc is not None and not isinstance(exc, SystemExit) and not isinstance(exc, Launched):
        return "traceback"
    if launched:
        return "wrote"
    out = result.output
    if "Traceback" in out:
        return "traceback"
    if result.exit_code == 0:
        return "ok"
    if changed:
        return "wrote"
    if result.exit_code == 2:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        ok = len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 10
        return "error_line" if ok else "bad_error"
    return "other_exit"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=20, help="seconds per case")
    ap.add_argument("--show", type=int, default=5, help="failing cases kept per outcome")
    ap.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    runner = CliRunner(env={"COLUMNS": "200"})
    launches: list[list[str]] = []

    def fake_call(cmd, *a, **k):
        launches.append(cmd)
        raise Launched()

    subprocess.call = fake_call  # train must never get this far on the inputs fuzzed here
    launch.supervise = fake_call
    signal.signal(signal.SIGALRM, _alarm)

    counts: Counter[str] = Counter()
    by_command: dict[str, Counter[str]] = {}
    failures: dict[str, list[dict]] = {}
    slowest: list[tuple[float, list[str]]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz_cli_") as tmp:
        workdir = Path(tmp)
        plans = []
        for i, job in enumerate([["tiny-moe", "h100", "--gpus", "8"],
                                 ["tiny-moe-shared", "h200", "--gpus", "4"],
                                 ["tiny-moe", "a100", "--gpus", "2"]]):
            out = workdir / f"p{i}.json"
            r = runner.invoke(app, ["search", *job, "--global-batch", "16", "--seq-len", "256",
                                    "--top", "1", "--out", str(out)])
            assert r.exit_code == 0, r.output
            plans.append(json.loads(out.read_text()))
        inputs = Inputs(rng, workdir / "cases", plans)
        inputs.dir.mkdir()
        results = Results(inputs)
        for n in range(args.cases):
            cmd, argv, what, watch = case(rng, inputs, results)
            before = watch.read_bytes() if watch is not None and watch.exists() else None
            launched_before = len(launches)
            t0 = time.perf_counter()
            signal.alarm(args.timeout)
            try:
                result = runner.invoke(app, argv)
            except (Hang, Launched) as e:  # BaseExceptions pass through CliRunner
                result = Escaped(e)
            finally:
                signal.alarm(0)
            dt = time.perf_counter() - t0
            after = watch.read_bytes() if watch is not None and watch.exists() else None
            outcome = classify(result, len(launches) > launched_before, after != before)
            counts[outcome] += 1
            by_command.setdefault(cmd, Counter())[outcome] += 1
            slowest = sorted([*slowest, (dt, argv)], key=lambda t: -t[0])[:5]
            if outcome not in ("ok", "error_line", "other_exit"):
                kept = failures.setdefault(outcome, [])
                if len(kept) < args.show:
                    exc = result.exception
                    kept.append({
                        "case": n, "argv": argv, "inputs": what, "exit_code": result.exit_code,
                        "output": result.output[-2000:],
                        "exception": None if exc is None else f"{type(exc).__name__}: {exc}",
                    })
            if (n + 1) % 1000 == 0:
                print(f"{n + 1} cases, {time.perf_counter() - start:.0f} s: {dict(counts)}",
                      flush=True)
    seconds = time.perf_counter() - start
    payload = {
        "cases": args.cases,
        "seed": args.seed,
        "timeout_s": args.timeout,
        "seconds": round(seconds, 1),
        "outcomes": {k: counts.get(k, 0) for k in ("ok", "error_line", "bad_error",
                                                   "other_exit", "traceback", "hang", "wrote")},
        "by_command": {c: dict(v) for c, v in sorted(by_command.items())},
        "failures": failures,
        "slowest_cases": [{"seconds": round(t, 3), "argv": a} for t, a in slowest],
        "command": f"python -m tests.reliability.fuzz_cli --cases {args.cases} --seed {args.seed}",
    }
    print(json.dumps(payload["outcomes"]), f"in {seconds:.0f} s")
    print(json.dumps(payload["by_command"]))
    for outcome, kept in failures.items():
        for f in kept[:2]:
            print(f"--- {outcome}: {f['argv']} ({f['inputs']})\n{f['exception'] or f['output']}")
    if not args.no_write:
        print("wrote", write("fuzz_cli", payload))
    bad = sum(counts[k] for k in ("traceback", "hang", "bad_error", "wrote"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
