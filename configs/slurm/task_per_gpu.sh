#!/bin/bash
# DDP under Slurm, srun starting one task per GPU: no torchrun. 2 nodes x 8 GPUs.
#
#   sbatch configs/slurm/task_per_gpu.sh                      # recipes.ddp_torchrun's defaults
#   sbatch configs/slurm/task_per_gpu.sh --model 100m --steps 200   # options go to the recipe
#   RECIPE=recipes.fsdp2 sbatch configs/slurm/task_per_gpu.sh       # another recipe
#
# Each task gets torchrun's variables from Slurm's, so any recipe written for torchrun runs as it
# is: RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS, LOCAL_RANK=SLURM_LOCALID (its GPU on the node);
# the rendezvous (MASTER_ADDR) is the first host of the node list, on a port derived from the job
# id (MASTER_PORT). Pitfall: without them each task is a world of 1 that trains alone.
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
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 10000 ))  # the job's own: two jobs may share a node
srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS \
        LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-1}
    exec python3 -m '"${RECIPE:-recipes.ddp_torchrun}"' "$@"' task "$@"
