"""Scripted hostile cases against the real `moeplan` processes (issue 14), every kind the issue
lists: files that never end or expand without bound, absurd numbers, markup and unprintable
names, odd output paths, `moeplan train` on bad input, signals to the launcher, torchrun and a
worker, damaged checkpoint manifests, another run's checkpoints, resuming under another layout.

Each case is a subprocess with a deadline; /proc is polled while it runs for torchrun, so a
worker launched on bad input is seen. A case is counted as

- hang:       its deadline passed (or processes it started were still running after it ended)
- traceback:  "Traceback" in its output
- launched:   torchrun started on input that must be refused first
- wrong:      the wrong outcome (exit 0 where it must fail, not exactly one `error:` line, a
              file changed that must not, a checkpoint lost, a resumed run that differs)
- ok:         none of these

    python -m tests.reliability.adversarial [--only KIND] [--no-write]

writes bench/results/adversarial.json (commit, date, counts per kind, failures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench._meta import write
from plans import CPAttention, catalog
from plans.enums import OptimizerSharding
from tests.runtime.dist_workers import make_plan

ROOT = Path(__file__).resolve().parents[2]

PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
HUGE = int("9" * 400)
BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9 if i else ['"x"'] * 9)
    + "]\n" for i in range(9))


@dataclass
class Run:
    code: int | None
    out: str
    err: str
    seconds: float
    launched: bool
    leftover: bool

    @property
    def text(self) -> str:
        return self.out + self.err

    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()
                and not ln.startswith(("note: ", "warning: "))]


@dataclass
class Case:
    kind: str
    name: str
    argv: list[str]
    refuse: bool = True
    """Must end in exit 2 (or the given code) with one `error:` line, before any worker."""
    check: Callable[[Run], str | None] | None = None
    """Extra verdict: a reason it is wrong, or None."""
    timeout_s: float = 60
    action: Callable[[subprocess.Popen], None] | None = None
    """Done to the running process (a signal); then the case must end within timeout_s."""
    codes: tuple[int, ...] = (2,)
    fails: bool = False
    """With refuse=False: must end non-zero (a stopped run) instead of 0."""
    command: list[str] = field(default_factory=lambda: ["-m", "planner.cli"])
    """What runs ``argv``: moeplan's CLI, or torchrun for the runtime's own options."""


def _processes() -> dict[int, bytes]:
    out = {}
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            out[int(p.parent.name)] = p.read_bytes()
    return out


def _ours(marker: str) -> list[int]:
    return [pid for pid, cmd in _processes().items()
            if marker.encode() in cmd and (b"runtime.train" in cmd or b"torch.distributed" in cmd)]


def execute(case: Case, marker: str) -> Run:
    start = time.monotonic()
    proc = subprocess.Popen([PY, *case.command, *case.argv], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="backslashreplace", start_new_session=True)
    launched = False
    acted = case.action is None
    deadline = start + case.timeout_s

    def drain(stream, sink):
        sink.append(stream.read())

    outs: list[str] = []
    errs: list[str] = []
    threads = [threading.Thread(target=drain, args=(proc.stdout, outs), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, errs), daemon=True)]
    for t in threads:
        t.start()
    while proc.poll() is None and time.monotonic() < deadline:
        if any(b"torch.distributed.run" in c and marker.encode() in c
               for c in _processes().values()):
            launched = True
        if not acted:
            acted = True
            case.action(proc)
            deadline = time.monotonic() + case.timeout_s
        time.sleep(0.05)
    hung = proc.poll() is None
    if hung:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for t in threads:
        t.join(timeout=10)
    settle = time.monotonic() + 15  # a killed launcher's torchrun stops its workers itself
    while (left := _ours(marker)) and time.monotonic() < settle:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return Run(None if hung else proc.returncode, "".join(outs), "".join(errs),
               time.monotonic() - start, launched, bool(left))


def verdict(case: Case, run: Run) -> str:
    if run.code is None or run.leftover:
        return "hang"
    if "Traceback" in run.text:
        return "traceback"
    if case.refuse and run.launched:
        return "launched"
    if case.refuse:
        lines = run.error_lines()
        if run.code not in case.codes or len(lines) != 1 or not lines[0].startswith("error: "):
            return "wrong"
    elif (run.code == 0) == case.fails:
        return "wrong"
    if case.check is not None and case.check(run) is not None:
        return "wrong"
    return "ok"


# ---- the cases ---------------------------------------------------------------------------


def input_cases(d: Path, plan: dict) -> list[Case]:
    """Files that are not documents, absurd numbers, unprintable names."""
    model = catalog.load_model("tiny-moe").model_dump(mode="json")
    cluster = catalog.load_cluster("h100").model_dump(mode="json")
    cases: list[Case] = []

    def put(name: str, doc) -> str:
        (d / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return str(d / name)

    fifo = d / "fifo.yaml"
    os.mkfifo(fifo)
    bomb, rec = put("bomb.yaml", BOMB), put("rec.yaml", "a: &a [*a]\n")
    for src in (bomb, rec, "/dev/zero", "/dev/urandom", str(fifo)):
        label = Path(src).name
        cases += [Case("hang", f"validate {label}", ["validate", src]),
                  Case("hang", f"explain {label}", ["explain", src]),
                  Case("hang", f"search model {label}", ["search", src, "h100", "--gpus", "8"]),
                  Case("hang", f"search cluster {label}", ["search", "tiny-moe", src,
                                                           "--gpus", "8"]),
                  Case("hang", f"calibrate {label}", ["calibrate", src, "--plan", src,
                                                      "--out", str(d / "c.yaml")]),
                  Case("hang", f"train {label}", ["train", src])]
    for cmd in (["search", "tiny-moe", "h100"], ["whatif", "tiny-moe", "h100", "--vary",
                                                 "hbm_gib=2x"], ["scale", "tiny-moe", "h100"]):
        for gpus in ("1e18", str(10**18), str(HUGE)):
            cases.append(Case("hang", f"{cmd[0]} --gpus {gpus[:8]}", [*cmd, "--gpus", gpus]))
    counts = ",".join(str(8 * i) for i in range(1, 301))
    cases.append(Case("hang", "scale over 300 GPU counts",
                      ["scale", "internal-352b", "h800", "--gpus", counts]))
    for field_ in ("vocab", "hidden", "layers", "experts", "head_dim", "query_heads",
                   "expert_ffn_hidden"):
        path = put(f"m_{field_}.json", {**model, field_: HUGE})
        cases.append(Case("traceback", f"model {field_} 400 digits",
                          ["search", path, "h100", "--gpus", "8"]))
    for part, field_ in (("gpu", "sms"), ("network", "nics_per_node"), ("node", "gpus_per_node"),
                         (None, "gpus")):
        doc = json.loads(json.dumps(cluster))
        (doc[part] if part else doc)[field_] = HUGE
        cases.append(Case("traceback", f"cluster {field_} 400 digits",
                          ["search", "tiny-moe", put(f"c_{field_}.json", doc), "--gpus", "8"]))
    for path_, value in ((("training", "global_batch"), HUGE), (("training", "seq_len"), HUGE),
                         (("model", "vocab"), HUGE), (("model", "hidden"), HUGE),
                         (("cluster", "network", "nics_per_node"), HUGE),
                         (("cluster", "gpu", "sms"), HUGE), (("degrees", "dp"), HUGE),
                         (("ffn", "capacity_factor"), 1e-320), (("ffn", "capacity_factor"), 5e-324),
                         (("ffn", "capacity_factor"), 1e308)):
        doc = json.loads(json.dumps(plan))
        target = doc
        for k in path_[:-1]:
            target = target[k]
        target[path_[-1]] = value
        shown = f"{value:.3g}" if isinstance(value, float) else f"{str(value)[:6]}..."
        p = put(f"p_{'_'.join(path_)}_{len(cases)}.json", doc)
        for cmd in ("validate", "explain"):
            cases.append(Case("traceback", f"{cmd} plan {'.'.join(path_)}={shown}", [cmd, p]))
    for i, name in enumerate(["[/bold]", "[red]x[/red]", "$x^{2", "a]b[/"]):
        doc = json.loads(json.dumps(plan))
        doc["model"]["name"] = doc["cluster"]["gpu"]["name"] = name
        p = put(f"markup{i}.json", doc)
        cases.append(Case("traceback", f"explain name {name!r}", ["explain", p], refuse=False,
                          check=lambda r, n=name: None if f"{n} on 8 x {n}" in r.out else "cut"))
        m = put(f"markup_model{i}.json", {**model, "name": name})
        cases.append(Case("traceback", f"scale --plot name {name!r}",
                          ["scale", m, "h100", "--gpus", "8", "--global-batch", "16",
                           "--seq-len", "256", "--plot", str(d / f"plot{i}.png")],
                          refuse=False))
    for i, name in enumerate(["bad\\ud800name", "two\\nlines"]):
        p = d / f"surrogate{i}.json"
        p.write_text(json.dumps({**model, "name": "NAME"}).replace("NAME", name))
        cases.append(Case("traceback", f"model name {name}", ["search", str(p), "h100",
                                                              "--gpus", "8"]))
    for field_, value in (("tokens_per_s", 1e30), ("step_time_s", -1), ("mfu", 50.0),
                          ("peak_memory_gib", -3)):
        doc = json.loads(json.dumps(plan))
        doc["prediction"][field_] = value
        cases.append(Case("wrong", f"validate tampered prediction.{field_}",
                          ["validate", put(f"tampered_{field_}.json", doc)]))
    return cases


def output_cases(d: Path, plan_path: str) -> list[Case]:
    """--out and --plot destinations a user would not expect to be written, or written half."""
    job = ["search", "tiny-moe", "h100", "--gpus", "8", "--global-batch", "16", "--seq-len",
           "256", "--top", "1"]
    (d / "file").write_text("mine\n")
    (d / "folder").mkdir()
    os.mkfifo(d / "fifo.json")
    (d / "target.json").write_text("target\n")
    (d / "link.json").symlink_to(d / "target.json")
    (d / "occupied.json").write_text("occupied\n")
    (d / ".occupied.json.tmp").mkdir()  # the old fixed temporary name, taken by a directory

    def unchanged(path: Path, text: str) -> Callable[[Run], str | None]:
        return lambda _r: None if path.read_text() == text else f"{path} changed"

    cases = []
    for name, out in (("parent is a file", d / "file" / "p.json"),
                      ("parent missing", d / "none" / "p.json"), ("a directory", d / "folder"),
                      ("a FIFO", d / "fifo.json"), ("a symlink", d / "link.json"),
                      ("/dev/null", Path("/dev/null")), ("name too long", d / ("x" * 300)),
                      ("impossible name", d / "folder" / ("y" * 5000))):
        for force in ([], ["--force"]):
            cases.append(Case("wrong", f"--out {name} {' '.join(force)}",
                              [*job, "--out", str(out), *force],
                              check=unchanged(d / "target.json", "target\n")))
    cases.append(Case("wrong", "--out over an existing file without --force",
                      [*job, "--out", str(d / "occupied.json")],
                      check=unchanged(d / "occupied.json", "occupied\n")))
    cases.append(Case("wrong", "--out beside a directory squatting on the old temp name",
                      [*job, "--out", str(d / "occupied.json"), "--force"], refuse=False,
                      check=lambda r: None if json.loads((d / "occupied.json").read_text())
                      .get("degrees") else "not a plan"))
    (d / "plot.png").write_text("my plot\n")
    cases.append(Case("wrong", "--plot over an existing file without --force",
                      ["scale", "tiny-moe", "h100", "--gpus", "8", "--global-batch", "16",
                       "--seq-len", "256", "--plot", str(d / "plot.png")],
                      check=unchanged(d / "plot.png", "my plot\n")))
    for name, out in (("occupied", d / "occupied.json"), ("a directory", d / "folder"),
                      ("under a file", d / "file" / "x.json")):
        cases.append(Case("wrong", f"profile --out {name}",
                          ["profile", str(ROOT / "bench" / "gpu_plans" / "mixtral2l_1gpu.json"),
                           "--out", str(out)]))
    return cases


def train_cases(d: Path) -> list[Case]:
    """`moeplan train` on bad input: refused before torchrun starts."""
    plan = d / "t2.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())  # vocab 256, seq 32, 2 ranks
    cp = d / "cp.json"
    cp.write_text(make_plan().model_copy(update={"attention": CPAttention()}).model_dump_json())
    big = make_plan()
    big = big.model_copy(update={"model": big.model.model_copy(update={"vocab": 2**32})})
    absurd = d / "vocab.json"
    absurd.write_text(big.model_dump_json())
    (d / "file").exists() or (d / "file").write_text("x")

    def tokens(name: str, data: bytes) -> str:
        (d / name).write_bytes(data)
        return str(d / name)

    import numpy as np

    bad_data = {
        "empty": tokens("empty.u16", b""),
        "odd bytes": tokens("odd.u16", b"\0" * 101),
        "shorter than a sequence": tokens("short.u16", np.zeros(10, np.uint16).tobytes()),
        "id 65535": tokens("big.u16", np.full(100, 65535, np.uint16).tobytes()),
        "id = vocab": tokens("vocab.u16", np.full(100, 256, np.uint16).tobytes()),
        "a directory": str(d / "folder.u16"),
        "a FIFO": str(d / "fifo.u16"),
    }
    (d / "folder.u16").mkdir()
    os.mkfifo(d / "fifo.u16")
    cases = [Case("launched", f"train --data {k}", ["train", str(plan), "--data", v])
             for k, v in bad_data.items()]
    for name, extra in (("--log a directory", ["--log", str(d)]),
                        ("--log in a missing folder", ["--log", str(d / "none" / "m.jsonl")]),
                        ("--ckpt-dir under a file", ["--ckpt-dir", str(d / "file" / "ck")]),
                        ("--ckpt-dir a file", ["--ckpt-dir", str(d / "file")]),
                        ("--nproc-per-node 3", ["--nproc-per-node", "3"])):
        cases.append(Case("launched", f"train {name}", ["train", str(plan), *extra]))
    cases.append(Case("launched", "train a CP-attention plan", ["train", str(cp)]))
    cases.append(Case("launched", "train vocab 2^32 (memory)", ["train", str(absurd)]))
    return cases


def _signal_case(d: Path, name: str, target: str, sig: int) -> Case:
    plan = d / f"s_{name}.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    ck = d / f"ck_{name}"

    def act(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 180
        while not (ck / "step-2").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs = _processes()
        if target == "launcher":
            pid = proc.pid
        elif target == "torchrun":
            pid = next(p for p, c in procs.items() if b"torch.distributed.run" in c
                       and str(plan).encode() in c)
        else:
            pid = max(p for p, c in procs.items() if b"runtime.train" in c and
                      b"torch.distributed.run" not in c and str(plan).encode() in c)
        os.kill(pid, sig)

    def intact(run: Run) -> str | None:
        from runtime import checkpoint

        found = checkpoint.find_resumable(ck, lambda _: None)
        if found is None:
            return "no complete checkpoint left"
        if target != "launcher" or sig != signal.SIGKILL:
            lines = run.error_lines()
            if len(lines) != 1 or not lines[0].startswith("error: "):
                return f"not one line: {lines}"
        return None

    codes = tuple(range(1, 256))
    return Case("signals", f"{signal.Signals(sig).name} to the {target}",
                ["train", str(plan), "--steps", "100000", "--ckpt-dir", str(ck),
                 "--ckpt-every", "2"], refuse=False, fails=True, action=act, timeout_s=30,
                codes=codes, check=intact)


def signal_cases(d: Path) -> list[Case]:
    return [_signal_case(d, f"{t}{s}", t, s) for t, s in (
        ("launcher", signal.SIGTERM), ("launcher", signal.SIGINT), ("launcher", signal.SIGHUP),
        ("launcher", signal.SIGKILL), ("torchrun", signal.SIGTERM), ("torchrun", signal.SIGKILL),
        ("worker", signal.SIGKILL), ("worker", signal.SIGTERM))]


def checkpoint_cases(d: Path) -> list[Case]:
    """Damaged manifests, another run's checkpoints, another layout; one-rank runs."""
    one = d / "one.json"
    one.write_text(make_plan().model_dump_json())
    base = d / "base_ck"
    r = subprocess.run([PY, "-m", "planner.cli", "train", str(one), "--steps", "2",
                        "--ckpt-dir", str(base), "--ckpt-every", "1"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cases = []

    def damaged(name: str, damage: Callable[[Path], None]) -> Case:
        ck = d / f"ck_{name}"
        shutil.copytree(base, ck)
        damage(ck / "step-2")

        def used_previous(run: Run) -> str | None:
            warned = [ln for ln in run.err.splitlines() if ln.startswith("warning: ")]
            if "after step 1" not in run.out or len(warned) != 1:
                return f"did not fall back to step-1: {warned} {run.out[-200:]}"
            return None

        return Case("checkpoints", f"manifest {name}",
                    ["train", str(one), "--steps", "3", "--ckpt-dir", str(ck), "--resume"],
                    refuse=False, check=used_previous, timeout_s=300)

    def manifest(edit: Callable[[dict], object]) -> Callable[[Path], None]:
        def apply(step: Path) -> None:
            doc = json.loads((step / "manifest.json").read_text())
            (step / "manifest.json").write_text(json.dumps(edit(doc)))
        return apply

    cases += [
        damaged("files as a list", manifest(lambda m: {**m, "files": list(m["files"])})),
        damaged("entry without checksum", manifest(lambda m: {**m, "files": {
            k: {"size": v["size"]} for k, v in m["files"].items()}})),
        damaged("a list", manifest(lambda m: [m])),
        damaged("path escaping the step", manifest(lambda m: {**m, "files": {
            "../../one.json": {"size": 1, "sha256": "0" * 64}}})),
        damaged("step is a string", manifest(lambda m: {**m, "step": "two"})),
    ]

    def step_is_file(step: Path) -> None:
        shutil.rmtree(step)
        step.write_text("not a directory")

    cases.append(damaged("step directory is a file", step_is_file))
    other = d / "other_ck"
    shutil.copytree(base, other)
    another = d / "another_job.json"  # another training spec: another run
    another.write_text(make_plan(global_batch=8).model_dump_json())
    untouched = {p.name: p.read_bytes() for p in (other / "step-2").iterdir()}

    def kept(_run: Run) -> str | None:
        now = {p.name: p.read_bytes() for p in (other / "step-2").iterdir()}
        return None if now == untouched else "the other run's checkpoint changed"

    cases.append(Case("wrong", "fresh run into another run's checkpoints",
                      ["train", str(another), "--steps", "2", "--ckpt-dir", str(other),
                       "--ckpt-every", "1"], check=kept))
    cases.append(Case("wrong", "--resume of another run's checkpoints",
                      ["train", str(another), "--steps", "3", "--ckpt-dir", str(other),
                       "--resume"], check=kept))
    return cases


def layout_cases(d: Path) -> list[Case]:
    """Resume under another layout: resharded (replicated states) or refused (ZeRO-1)."""
    cases = []
    one = d / "l_one.json"
    one.write_text(make_plan().model_dump_json())
    for name, layout in (("pp2", dict(pp=2, stage_layers=(2, 2))), ("dp2", dict(dp=2)),
                         ("sp2ep2", dict(sp=2, ep=2)), ("dp2ep2", dict(dp=2, ep=2))):
        (d / f"l_{name}.json").write_text(make_plan(**layout).model_dump_json())
    base = d / "l_base"
    r = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        "2", "-m", "runtime.train", "--plan", str(d / "l_dp2.json"), "--steps",
                        "2", "--ckpt-dir", str(base), "--ckpt-every", "2"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    zero = d / "l_zero"
    zero_plan = d / "l_one_zero1.json"
    zero_plan.write_text(make_plan(optimizer_sharding=OptimizerSharding.zero1).model_dump_json())
    r = subprocess.run([PY, "-m", "planner.cli", "train", str(zero_plan), "--steps", "2",
                        "--ckpt-dir", str(zero), "--ckpt-every", "2"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "runtime.train"]
    for name in ("pp2", "sp2ep2", "dp2ep2"):
        ck = d / f"l_ck_{name}"
        shutil.copytree(base, ck)
        cases.append(Case("layouts", f"dp2 -> {name} (optimizer_sharding none)", [
            "--plan", str(d / f"l_{name}.json"), "--steps", "3", "--ckpt-dir", str(ck),
            "--resume"], refuse=False, timeout_s=180, command=torchrun,
            check=lambda r: None if "after step 2" in r.out else "did not resume"))
    ck = d / "l_ck_one"
    shutil.copytree(base, ck)
    cases.append(Case("layouts", "dp2 -> one rank (optimizer_sharding none)", [
        "--plan", str(one), "--steps", "3", "--ckpt-dir", str(ck), "--resume"],
        refuse=False, timeout_s=180, command=["-m", "runtime.train"],
        check=lambda r: None if "after step 2" in r.out else "did not resume"))
    for name in ("pp2", "sp2ep2", "dp2ep2"):
        cases.append(Case("layouts", f"zero1 one rank -> {name} refused", [
            "train", str(d / f"l_{name}.json"), "--steps", "3", "--ckpt-dir", str(zero),
            "--resume"]))
    return cases


KINDS = {"inputs": input_cases, "outputs": output_cases, "train": train_cases,
         "signals": signal_cases, "checkpoints": checkpoint_cases, "layouts": layout_cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(KINDS), action="append")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    counts: Counter[str] = Counter()
    by_group: dict[str, Counter[str]] = {}
    failures = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="adversarial_") as tmp:
        d = Path(tmp)
        plan_path = d / "plan.json"
        r = subprocess.run([PY, "-m", "planner.cli", "search", "tiny-moe", "h100", "--gpus", "8",
                            "--global-batch", "16", "--seq-len", "256", "--top", "1", "--out",
                            str(plan_path)], cwd=ROOT, env=ENV, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        plan = json.loads(plan_path.read_text())
        for group, make in KINDS.items():
            if args.only and group not in args.only:
                continue
            sub = d / group
            sub.mkdir()
            cases = make(sub, plan) if group == "inputs" else (
                make(sub, str(plan_path)) if group == "outputs" else make(sub))
            for case in cases:
                run = execute(case, str(sub))
                outcome = verdict(case, run)
                counts[outcome] += 1
                by_group.setdefault(group, Counter())[outcome] += 1
                print(f"{outcome:9s} {run.seconds:6.1f}s {group}: {case.name}", flush=True)
                if outcome != "ok":
                    failures.append({"group": group, "case": case.name, "outcome": outcome,
                                     "exit": run.code, "stderr": run.err[-800:],
                                     "stdout": run.out[-300:]})
    payload = {
        "cases": sum(counts.values()),
        "seconds": round(time.monotonic() - start, 1),
        "outcomes": {k: counts.get(k, 0) for k in ("ok", "hang", "traceback", "launched",
                                                   "wrong")},
        "by_group": {g: dict(c) for g, c in by_group.items()},
        "failures": failures,
        "command": "python -m tests.reliability.adversarial",
    }
    print(json.dumps(payload["outcomes"]), json.dumps(payload["by_group"]))
    for f in failures[:10]:
        print(f"--- {f['outcome']}: {f['group']}: {f['case']}\n{f['stderr']}")
    if not args.no_write and not args.only:
        print("wrote", write("adversarial", payload))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
