#!/usr/bin/env bash
# One node's part of a training job on several nodes under Slurm: train.sbatch runs it once per
# node (srun, one task per node), and it starts torchrun with the job's rendezvous there, the
# node's ranks using the node's own tierd (the systemd service on every node).
#
#   torchrun-node.sh SCRIPT [ARGS...]
#
# From Slurm: SLURM_NNODES, SLURM_JOB_ID, SLURM_GPUS_ON_NODE (the ranks on this node, one per GPU;
# TIERD_RANKS_PER_NODE overrides it). From train.sbatch: TIERD_RDZV_HOST, the node that hosts the
# rendezvous. Optional: TIERD_RDZV_PORT (29500), TIERD_SOCKET_DIR (/run/tierd), TIERD_TORCHRUN
# (the launcher: torchrun; "python3 -m tierd.torchrun" where torch 1.13's fails on Python 3.11).
set -euo pipefail

export TIERD_SOCKET_DIR="${TIERD_SOCKET_DIR:-/run/tierd}"
node=$(hostname)
# A node without its daemon fails here, at once and by name; srun --kill-on-bad-exit stops the
# other nodes instead of leaving them waiting at the rendezvous.
if [[ ! -S "$TIERD_SOCKET_DIR/tierd.session.sock" ]]; then
  echo "torchrun-node: no tierd on $node (no socket in $TIERD_SOCKET_DIR): start it there" \
       "(systemctl start tierd), or set TIERD_SOCKET_DIR to its socket directory" >&2
  exit 1
fi

ranks="${TIERD_RANKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
read -r -a launcher <<< "${TIERD_TORCHRUN:-torchrun}"
exec "${launcher[@]}" \
  --nnodes="$SLURM_NNODES" --nproc_per_node="$ranks" \
  --rdzv_backend=c10d --rdzv_endpoint="$TIERD_RDZV_HOST:${TIERD_RDZV_PORT:-29500}" \
  --rdzv_id="$SLURM_JOB_ID" --max_restarts=0 \
  "$@"
