"""Write the plans (bench/gpu_plans/) the GPU benchmarks run: a reduced Mixtral-8x7B
(2 layers, full width) on one and two H200s, in the layouts worth comparing. Plans are data:
regenerate with
    python bench/make_gpu_plans.py
"""

from __future__ import annotations

from pathlib import Path

from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)

OUT = Path(__file__).parent / "gpu_plans"


def model(layers: int):
    full = catalog.load_model("mixtral-8x7b")
    return full.model_copy(update={"name": f"Mixtral-8x7B-{layers}L", "layers": layers})


def plan(gpus: int, degrees: Degrees, layers: int = 2, **kw) -> Plan:
    chunks = degrees.pp * degrees.vpp
    base = dict(
        model=model(layers), cluster=catalog.load_cluster("h200", gpus=gpus),
        training=TrainingSpec(global_batch=8, seq_len=4096), degrees=degrees,
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=Dispatch.all_to_all),
        stage_layers=(layers // chunks,) * chunks, micro_batch_size=1,
        overlap=Overlap.none, recompute=Recompute.none, grad_sync_precision=Precision.bf16,
    )
    return Plan(**{**base, **kw})


PLANS = {
    "mixtral2l_1gpu": plan(1, Degrees()),
    "mixtral2l_sp2_ep2_a2a": plan(2, Degrees(sp=2, ep=2)),
    "mixtral2l_sp2_ep2_ag": plan(2, Degrees(sp=2, ep=2),
                                 ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    "mixtral2l_dp2_ep2": plan(2, Degrees(dp=2, ep=2)),
    "mixtral2l_tp2_ep2": plan(2, Degrees(tp=2, ep=2), attention=TPAttention()),
    "mixtral2l_pp2": plan(2, Degrees(pp=2)),
    "mixtral2l_tp2_etp2": plan(2, Degrees(tp=2, etp=2), attention=TPAttention(), ffn=TPFFN(),
                               grad_sync_precision=Precision.fp32),
    "mixtral4l_pp2_vpp2": plan(2, Degrees(pp=2, vpp=2), layers=4,
                               schedule=PipelineSchedule.interleaved_1f1b),
    "mixtral2l_sp2_ep2_fp8sync": plan(
        2, Degrees(sp=2, ep=2), grad_sync_precision=Precision.fp8,
        training=TrainingSpec(global_batch=8, seq_len=4096, precision=Precision.fp8)),
}


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, p in PLANS.items():
        (OUT / f"{name}.json").write_text(p.model_dump_json(indent=2) + "\n")
        print(name, p.summary())


if __name__ == "__main__":
    main()
