#!/bin/bash
# DDP under Slurm, srun starting torchrun once per node; torchrun starts one process per GPU.
#
#   sbatch configs/slurm/torchrun_per_node.sh                 # recipes.ddp_torchrun's defaults
#   sbatch configs/slurm/torchrun_per_node.sh --model 100m --steps 200   # options go to the recipe
#   RECIPE=recipes.fsdp2 sbatch configs/slurm/torchrun_per_node.sh       # another recipe
#
# The same torchrun command on every node: c10d rendezvous at the first host of the node list,
# which hosts the store; torchrun numbers the nodes and sets RANK, WORLD_SIZE and LOCAL_RANK.
# Pitfall: one task per node (--ntasks-per-node=1), or every node starts several torchruns.
#SBATCH --job-name=ddp-torchrun-per-node
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# the GPUs Slurm gave this node (1 process on a node without GPUs)
procs_per_node=${SLURM_GPUS_ON_NODE:-1}
cpus=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=$(( cpus >= procs_per_node ? cpus / procs_per_node : 1 ))

# --kill-on-bad-exit: a node whose torchrun fails stops the other at once instead of leaving it
# waiting in the rendezvous. The port is the job's own, so two jobs that share a node differ.
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc-per-node="$procs_per_node" \
    --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d \
    --rdzv-endpoint="$head_node:$(( 20000 + SLURM_JOB_ID % 10000 ))" \
    -m ${RECIPE:-recipes.ddp_torchrun} "$@"
