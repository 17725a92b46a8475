# A/B of the accumulating experts on 1 GPU (Mixtral-8x7B's few wide experts, under
# grad_accumulation_fusion): one cuBLAS matmul per expert in the forward and both gradients,
# the row counts read on the host in the forward (runtime/parallel/grad_accumulation.py of
# 6bb9e8b), against this tree's grouped forward and rows' gradient with per-expert weight
# gradients. One device call, after bench/run_campaign.sh's wheels are in /tmp/site:
#   MOEPLAN_COMMIT=<sha> bash bench/ab/ab_experts.sh
# (a tree sent without .git: PER_EXPERT_FILE=<6bb9e8b's file, carried>). The MoE layer against
# torchtitan's in each form, the expert GEMM variants, and the two 1-GPU train steps with
# fusion in each form (the fused one A/B/A); results in $R (measured at 6bb9e8b, where the
# tree's own file was the per-expert form: speed19/ab_experts).
set -u
R=bench/results/h200/speed19/ab_experts; mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F=runtime/parallel/grad_accumulation.py
C=${MOEPLAN_COMMIT:?set MOEPLAN_COMMIT}
cp $F /tmp/ga_grouped.py
git show 6bb9e8b:$F > /tmp/ga_per_expert.py 2>/dev/null ||
  cp "${PER_EXPERT_FILE:?no .git here: set PER_EXPERT_FILE to $F of 6bb9e8b}" /tmp/ga_per_expert.py
use() {  # use grouped|per_expert
  cp /tmp/ga_$1.py $F
  if [ "$1" = per_expert ]; then export MOEPLAN_COMMIT="$C with $F of 6bb9e8b"
  else export MOEPLAN_COMMIT=$C; fi
}
layer() {
  timeout 150 python -m bench.layers.moe_layer_gpu --shapes mixtral-8x7b --kernels fused \
    --grad-accumulation-fusion --out $R/moe_layer_x1_fused_gaf_$1.json > $R/moe_layer_$1.log 2>&1
  tail -2 $R/moe_layer_$1.log
}
step() {
  timeout 90 python -m bench.steps.train_step --plan bench/gpu_plans/$2.json --steps 5 --warmup 2 \
    --out $R/train_step_$2_$1.json > $R/train_step_$2_$1.log 2>&1
  tail -1 $R/train_step_$2_$1.log
}
use per_expert; layer per_expert
use grouped;    layer grouped
use per_expert
timeout 120 python -m bench.kernels.expert_gemm_gpu --shape mixtral-8x7b --out $R/expert_gemm_mixtral.json \
  > $R/expert_gemm_mixtral.log 2>&1; tail -4 $R/expert_gemm_mixtral.log
use grouped;    step grouped_a mixtral2l_1gpu_mbs8_fused_gaf
use per_expert; step per_expert mixtral2l_1gpu_mbs8_fused_gaf
use grouped;    step grouped_b mixtral2l_1gpu_mbs8_fused_gaf
use per_expert; step per_expert mixtral2l_1gpu_gaf
use grouped;    step grouped mixtral2l_1gpu_gaf
