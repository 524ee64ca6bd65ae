#!/bin/bash
# DDP under Slurm, srun starting one task per GPU: no torchrun. 2 nodes x 8 GPUs.
#
#   sbatch configs/slurm/task_per_gpu.sh                      # recipes.ddp_torchrun's defaults
#   sbatch configs/slurm/task_per_gpu.sh --model 100m --steps 200   # options go to the recipe
#
# Every task reads its place in the world from Slurm: SLURM_PROCID (rank), SLURM_NTASKS (world
# size), SLURM_LOCALID (its GPU on the node); the rendezvous is the first host of the node list,
# on a port derived from the job id (recipes/dist_setup.py; recipes.core.world reads the same).
# Pitfall: --ntasks-per-node must equal --gpus-per-node, one process per GPU.
#SBATCH --job-name=ddp-task-per-gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# NCCL (gloo: GLOO_SOCKET_IFNAME): name the interface between the nodes if they have several,
# e.g. export NCCL_SOCKET_IFNAME=ib0

# --kill-on-bad-exit: when one task fails (a bad option, an exception) srun stops the others at
# once; without it they wait for the missing peer until their collective timeout. Run from the
# repository (sbatch starts the script in the directory it was submitted from).
srun --kill-on-bad-exit=1 python3 -m recipes.ddp_torchrun "$@"
