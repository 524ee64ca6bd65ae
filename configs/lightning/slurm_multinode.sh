#!/bin/bash
# Multi-node Lightning training under SLURM: 2 nodes x 8 GPUs, the DDP config from this folder.
#
#   sbatch configs/lightning/slurm_multinode.sh                       # DDP
#   CONFIG=configs/lightning/fsdp.yaml sbatch configs/lightning/slurm_multinode.sh
#
# srun starts one task per GPU on every node; Lightning's SLURMEnvironment reads SLURM_PROCID,
# SLURM_LOCALID, SLURM_NODEID and SLURM_NTASKS, so nobody runs torchrun. Pitfall: the Trainer's
# devices x num_nodes must equal --ntasks-per-node x --nodes, or Lightning stops with a mismatch
# error.
#SBATCH --job-name=lightning-recipe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
CONFIG=${CONFIG:-configs/lightning/ddp.yaml}
NODES=$SLURM_JOB_NUM_NODES
DEVICES_PER_NODE=$SLURM_NTASKS_PER_NODE   # one task per device
# ACCELERATOR=cpu runs the same script on nodes without GPUs (tests/test_slurm.py does).
ACCELERATOR=${ACCELERATOR:-cuda}

# Node 0's address for the rendezvous (Lightning also derives it from SLURM_NODELIST when unset);
# the port: Lightning derives one from the job id, so two jobs sharing a node do not collide.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# NCCL: name the fabric interface if the nodes have several (e.g. export NCCL_SOCKET_IFNAME=ib0).

# Checkpoints and logs must be on a filesystem every node sees: FSDP "sharded" checkpoints are
# written by every rank, and --ckpt_path is read by every rank on resume.
# --kill-on-bad-exit: a task that fails stops the others at once instead of leaving them waiting
# for it until their collective timeout.
srun --kill-on-bad-exit=1 python3 -m recipes.lightning_trainer fit --config "$CONFIG" \
    --trainer.accelerator "$ACCELERATOR" \
    --trainer.devices "$DEVICES_PER_NODE" \
    --trainer.num_nodes "$NODES" \
    --trainer.logger.init_args.save_dir "${LOG_DIR:-$PWD/lightning_logs}" \
    "$@"

# The dataclass path runs the same way: srun sets no torchrun variables, so launch torchrun per
# node instead:
#   srun --ntasks-per-node=1 torchrun --nnodes="$NODES" --nproc_per_node="$GPUS_PER_NODE" \
#       --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
#       -m recipes.lightning_trainer --strategy fsdp --model 100m
