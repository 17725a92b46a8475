# A/B/A of the eager optimizer step on 1 GPU (mixtral2l_1gpu_mbs1): bucket by bucket (this tree)
# against every gradient cast at once (runtime/parallel/optimizer.py of 8bc713e); one device call:
#   MOEPLAN_COMMIT=<sha> bash bench/ab/ab_optimizer.sh   (after bench/run_campaign.sh installed /tmp/site)
set -u
R=bench/results/h200/ab_optimizer; mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cp runtime/parallel/optimizer.py /tmp/optimizer_now.py
run() { python -m bench.steps.train_step --plan bench/gpu_plans/fidelity/mixtral2l_1gpu_mbs1.json --steps 10 --warmup 2 --out $R/train_step_mixtral2l_1gpu_mbs1_$1.json 2>&1 | tail -1; }
run bucketed_a
git show 8bc713e:runtime/parallel/optimizer.py > /tmp/optimizer_8bc713e.py 2>/dev/null ||
  cp bench/ab/optimizer_8bc713e.py /tmp/optimizer_8bc713e.py  # a tree sent without .git
cp /tmp/optimizer_8bc713e.py runtime/parallel/optimizer.py
MOEPLAN_COMMIT="$MOEPLAN_COMMIT with runtime/parallel/optimizer.py of 8bc713e" run whole
cp /tmp/optimizer_now.py runtime/parallel/optimizer.py
run bucketed_b
