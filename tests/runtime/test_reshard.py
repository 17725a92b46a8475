"""Resume under another layout (issue 14): checkpoints with replicated optimizer states
(optimizer_sharding none) are resharded on load; ZeRO-1 checkpoints are refused in one line.
On CPU in fp32 one rank and pp2 run bit-identical steps, so a run handed between them through
its checkpoints is checked bit for bit against the uninterrupted run; dp2 x ep2 sums expert
gradients in another order, so there the loaded state itself is checked: exact slices of the
one-rank tensors, and joined back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from dist_workers import make_plan

from plans.enums import OptimizerSharding
from runtime import checkpoint

COMMON = ["--lr", "1e-2", "--per-expert-balance", "--seed", "3"]  # plans: optimizer_sharding none


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _stored(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint under its stored key (read in this process)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
           if hasattr(m, "size")}
    dcp.load(out, checkpoint_id=str(path))
    return out


def test_one_rank_pp2_one_rank_resumes_bit_exactly(pool2, train_here, tmp_path):
    # one rank and pp2 run bit-identical steps on CPU: a run handed between them through its
    # checkpoints has the uninterrupted run's losses to the last bit
    one, pp2 = tmp_path / "one.json", tmp_path / "pp2.json"
    one.write_text(make_plan().model_dump_json())
    pp2.write_text(make_plan(pp=2, stage_layers=(2, 2)).model_dump_json())
    ck, logs = tmp_path / "ck", {n: tmp_path / f"{n}.jsonl" for n in ("ref", "pp2", "one")}
    r = train_here("--plan", str(one), *COMMON, "--steps", "4", "--log", str(logs["ref"]))
    assert r.returncode == 0, r.stderr
    ref = _losses(logs["ref"])
    r = train_here("--plan", str(one), *COMMON, "--ckpt-dir", str(ck), "--steps", "2",
                   "--ckpt-every", "2")
    assert r.returncode == 0, r.stderr
    assert pool2.run("dist_workers", "train_main",
                     ["--plan", str(pp2), *COMMON, "--ckpt-dir", str(ck), "--steps", "3",
                      "--ckpt-every", "1", "--resume", "--log", str(logs["pp2"])]) == [0, 0]
    r = train_here("--plan", str(one), *COMMON, "--ckpt-dir", str(ck), "--steps", "4",
                   "--resume", "--log", str(logs["one"]))
    assert r.returncode == 0, r.stderr
    assert "after step 3" in r.stdout
    assert _losses(logs["pp2"]) == {3: ref[3]}
    assert _losses(logs["one"]) == {4: ref[4]}


def test_expert_and_data_parallel_resume_take_exact_slices(pool2, train_here, tmp_path):
    # one rank's checkpoint loaded under dp2 x ep2: each rank holds its half of every expert
    # tensor (AdamW states too) and whole copies of the rest, bit for bit
    one, ep = make_plan(), make_plan(dp=2, ep=2)
    (tmp_path / "one.json").write_text(one.model_dump_json())
    ck = tmp_path / "ck"
    r = train_here("--plan", str(tmp_path / "one.json"), *COMMON, "--ckpt-dir", str(ck),
                   "--steps", "1", "--ckpt-every", "1")
    assert r.returncode == 0, r.stderr
    whole = _stored(ck / "step-1")
    ranks = pool2.run("dist_workers", "loaded_checkpoint", ep.model_dump_json(),
                      str(ck / "step-1"))
    sliced = 0
    for rank, state in enumerate(ranks):
        for key, value in state.items():
            if key == "trainer.step":  # a fresh tensor per state_dict call, not loaded state
                continue
            m = checkpoint._KEY.match(key)
            if m and m["i"] is not None:
                base = f"{m['head']}.{m['base']}{m['tail'] or ''}"
                assert int(m["i"]) == rank and int(m["n"]) == 2, key
                full = whole[base]
                assert torch.equal(value, full.chunk(2, dim=0)[rank] if full.dim() else full), key
                sliced += 1
            else:
                assert torch.equal(value, whole[key]), key
    assert sliced >= 6 * one.model.layers  # w1, w3, w2 and their exp_avg, exp_avg_sq per layer
    # and back: dp2 x ep2's own checkpoint loaded by one rank joins the pieces exactly
    (tmp_path / "ep.json").write_text(ep.model_dump_json())
    ck2 = tmp_path / "ck2"
    assert pool2.run("dist_workers", "train_main",
                     ["--plan", str(tmp_path / "ep.json"), *COMMON, "--ckpt-dir", str(ck2),
                      "--steps", "1", "--ckpt-every", "1"]) == [0, 0]
    pieces = _stored(ck2 / "step-1")
    joined = _load_on_one_rank(one, ck2 / "step-1")
    for key, value in joined.items():
        if key == "trainer.step":
            continue
        if key in pieces:
            expected = pieces[key]
        else:
            m = checkpoint._KEY.match(key)
            tail = m["tail"] or ""
            parts = [pieces[f"{m['head']}.{m['base']}.shard{i}of2{tail}"] for i in range(2)]
            expected = torch.cat(parts, dim=0) if parts[0].dim() else parts[0]
        assert torch.equal(value, expected), key


def _load_on_one_rank(plan, path: Path) -> dict[str, torch.Tensor]:
    """A one-rank trainer of ``plan`` in this process (no process group), loaded from ``path``."""
    from runtime.data import SyntheticTokens
    from runtime.parallel.optimizer import OptimizerConfig
    from runtime.trainer import build_trainer

    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, 0)
    trainer = build_trainer(plan, 0, 1, torch.device("cpu"), 0, data,
                            optim=OptimizerConfig(lr=1e-2))
    checkpoint.load(trainer, path)
    return {k: v.detach().clone() for k, v in checkpoint.state_dict(trainer).items()}


def test_zero1_checkpoints_are_not_resharded(train_here, tmp_path):
    one, pp2 = tmp_path / "one.json", tmp_path / "pp2.json"
    zero1 = dict(optimizer_sharding=OptimizerSharding.zero1)
    one.write_text(make_plan(**zero1).model_dump_json())
    pp2.write_text(make_plan(pp=2, stage_layers=(2, 2), **zero1).model_dump_json())
    ck = tmp_path / "ck"
    r = train_here("--plan", str(one), "--ckpt-dir", str(ck), "--steps", "1", "--ckpt-every", "1")
    assert r.returncode == 0, r.stderr
    r = train_here("--plan", str(pp2), "--ckpt-dir", str(ck), "--resume", "--steps", "2",
                   "--check", world=2)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("error: --resume:") and "ZeRO-1" in line
    assert checkpoint.verify(ck / "step-1") is None
