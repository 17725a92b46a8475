#!/usr/bin/env bash
# The one command of a device call: bash bench/run_campaign.sh NAME (a campaign of
# bench/campaigns.yaml). Sets the environment of the GPU machines, installs the pydantic wheels
# carried in .whl/ (pydantic is not installed there), and hands over to bench.campaign.
# The copy of the tree a device call sends can carry another commit's git metadata: name the
# tree that runs, MOEPLAN_COMMIT=$(git rev-parse --short HEAD) bash bench/run_campaign.sh NAME
# (runtime.provenance.commit reads it), or results record that other commit.
set -uo pipefail
# NVLink multicast (NVLS) stays off on the lent machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPU(s)')"
exec python3 -m bench.campaign "$@"
