#!/usr/bin/env bash
# Multi-node jmoe training under SLURM: one process per node (driving all of its GPUs), or one per
# GPU. Every process runs the same command; JAX reads SLURM's variables to join them
# (jmoe/distributed.py), and the run is one SPMD program over all GPUs.
#
#   sbatch --nodes=4 scripts/launch_slurm.sh --config configs/qwen3_30b_a3b.py \
#       --workdir /shared/runs/qwen3 [--config.group.key=value ...]
#   sbatch --nodes=4 --ntasks-per-node=8 scripts/launch_slurm.sh ...   # one process per GPU
#
# The workdir must be on storage every node sees (checkpoints are written by all processes).
# SLURM sends SIGTERM two minutes before the time limit: jmoe saves a checkpoint of the step it is
# at and exits; submitting the same command again resumes it.
#SBATCH --job-name=jmoe
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=TERM@120
#SBATCH --output=jmoe-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON=${PYTHON:-python}

# Let XLA's GPU client take most of each GPU's memory up front (the default is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# NCCL: report problems, not progress. Network choices (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...)
# belong to the cluster; set them in the environment that calls sbatch, and they pass through.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# jmoe adds its XLA flags (the latency-hiding scheduler, jmoe/xla_flags.py) to any given here.
export XLA_FLAGS=${XLA_FLAGS:-}

tasks_per_node=${SLURM_NTASKS_PER_NODE:-1}
echo "jmoe: ${SLURM_NNODES:-1} node(s) x ${tasks_per_node} process(es), job ${SLURM_JOB_ID:-?}"
# With one process per GPU, each process sees only its own GPU.
srun --kill-on-bad-exit=1 bash -c '
  if [ "${SLURM_NTASKS_PER_NODE:-1}" -gt 1 ]; then export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; fi
  exec "$0" -m jmoe.train "$@"' "$PYTHON" "$@"
