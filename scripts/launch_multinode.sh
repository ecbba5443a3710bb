#!/usr/bin/env bash
# Launch a distributed mtp-train stage (precompute or train) on N nodes with torchrun and c10d rendezvous.
# Run the same command on every node; only NODE_RANK differs. See `scripts/launch_multinode.sh --help`.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/launch_multinode.sh [OPTIONS] [--] SUBCOMMAND [ARGS...]

Runs `torchrun ... -m mtp_train SUBCOMMAND ARGS...` on this node as one of NNODES nodes. Start it on every node
with the same settings and a different NODE_RANK (0 .. NNODES-1). SUBCOMMAND is a distributed stage: precompute or
train; ARGS pass through unchanged (--recipe, --set, ...). Run prepare, eval and export on one node without torchrun.

Options (each defaults to the environment variable of the same name, then to the value shown):
  --nnodes N            NNODES         number of nodes (1)
  --node-rank R         NODE_RANK      this node's index, 0 .. N-1 (0); node 0 hosts the rendezvous store
  --master-addr HOST    MASTER_ADDR    address of node 0, reachable from every node (required when N > 1)
  --master-port PORT    MASTER_PORT    rendezvous port on node 0 (29500)
  --gpus-per-node G     GPUS_PER_NODE  processes (GPUs) per node (8)
  --rdzv-id ID          RDZV_ID        job id shared by all nodes (mtp-train-<MASTER_PORT>)
  --dry-run                            print the torchrun command instead of running it
  -h, --help                           show this help

Environment: TORCHRUN (torchrun executable, default: torchrun), OMP_NUM_THREADS (default 1 per process here).
NCCL over InfiniBand/RoCE picks its interfaces itself; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA if it picks wrong ones
(NCCL_DEBUG=INFO shows what it chose).

Example, 2 nodes × 8 GPUs (16 ranks), training the Llama-3.3-70B head with the same 524,288-token global batch as
on one node (grad_accum 4 × 8 ranks = 2 × 16 ranks):

  # on node 0 (10.0.0.1)
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch_multinode.sh \
      train --recipe recipes/llama-3.3-70b-mtp.yaml --set train.grad_accum=2
  # on node 1
  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/launch_multinode.sh \
      train --recipe recipes/llama-3.3-70b-mtp.yaml --set train.grad_accum=2

Every node must see the same repository, recipe, data/ (prepared data and feature cache on a shared filesystem)
and runs/ directory: precompute writes each rank's shards and train writes checkpoints from every rank.
EOF
}

die() {
  printf 'launch_multinode.sh: error: %s\n' "$1" >&2
  printf "Try 'scripts/launch_multinode.sh --help'.\n" >&2
  exit 2
}

need_value() {  # $1 = option name, $2 = number of remaining arguments
  if [[ "$2" -lt 2 ]]; then
    die "$1 needs a value"
  fi
}

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RDZV_ID="${RDZV_ID:-}"
TORCHRUN="${TORCHRUN:-torchrun}"
DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --nnodes) need_value "$1" "$#"; NNODES="$2"; shift 2 ;;
    --nnodes=*) NNODES="${1#*=}"; shift ;;
    --node-rank) need_value "$1" "$#"; NODE_RANK="$2"; shift 2 ;;
    --node-rank=*) NODE_RANK="${1#*=}"; shift ;;
    --master-addr) need_value "$1" "$#"; MASTER_ADDR="$2"; shift 2 ;;
    --master-addr=*) MASTER_ADDR="${1#*=}"; shift ;;
    --master-port) need_value "$1" "$#"; MASTER_PORT="$2"; shift 2 ;;
    --master-port=*) MASTER_PORT="${1#*=}"; shift ;;
    --gpus-per-node) need_value "$1" "$#"; GPUS_PER_NODE="$2"; shift 2 ;;
    --gpus-per-node=*) GPUS_PER_NODE="${1#*=}"; shift ;;
    --rdzv-id) need_value "$1" "$#"; RDZV_ID="$2"; shift 2 ;;
    --rdzv-id=*) RDZV_ID="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
done

if [[ $# -lt 1 ]]; then
  die "missing SUBCOMMAND (precompute or train)"
fi
SUBCOMMAND="$1"
shift
case "$SUBCOMMAND" in
  precompute | train) ;;
  *) die "SUBCOMMAND must be precompute or train (the distributed stages), got '$SUBCOMMAND'" ;;
esac

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
if ! is_uint "$NNODES" || [[ "$NNODES" -lt 1 ]]; then
  die "NNODES must be an integer >= 1, got '$NNODES'"
fi
if ! is_uint "$GPUS_PER_NODE" || [[ "$GPUS_PER_NODE" -lt 1 ]]; then
  die "GPUS_PER_NODE must be an integer >= 1, got '$GPUS_PER_NODE'"
fi
if ! is_uint "$NODE_RANK" || [[ "$NODE_RANK" -ge "$NNODES" ]]; then
  die "NODE_RANK must be an integer in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
if ! is_uint "$MASTER_PORT" || [[ "$MASTER_PORT" -lt 1 || "$MASTER_PORT" -gt 65535 ]]; then
  die "MASTER_PORT must be a port number, got '$MASTER_PORT'"
fi
if [[ -z "$MASTER_ADDR" ]]; then
  if [[ "$NNODES" -gt 1 ]]; then
    die "MASTER_ADDR (node 0's address) is required when NNODES > 1"
  fi
  MASTER_ADDR=127.0.0.1
fi
RDZV_ID="${RDZV_ID:-mtp-train-$MASTER_PORT}"

# Node 0 hosts the c10d rendezvous store explicitly (is_host), so it does not depend on MASTER_ADDR matching the
# node's hostname; the others connect to it. Under c10d the rendezvous assigns the ranks (torchrun ignores, and warns
# about, --node-rank), so NODE_RANK only decides which node hosts the store.
if [[ "$NODE_RANK" -eq 0 ]]; then IS_HOST=1; else IS_HOST=0; fi

CMD=(
  "$TORCHRUN"
  --nnodes="$NNODES"
  --nproc-per-node="$GPUS_PER_NODE"
  --rdzv-backend=c10d
  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
  --rdzv-id="$RDZV_ID"
  --rdzv-conf="is_host=$IS_HOST"
  -m mtp_train "$SUBCOMMAND" "$@"
)

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ "$DRY_RUN" -eq 1 ]]; then
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi
printf 'launch_multinode.sh: node %s of %s, %s process(es), rendezvous %s:%s (id %s)\n' \
  "$NODE_RANK" "$NNODES" "$GPUS_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" "$RDZV_ID" >&2
exec "${CMD[@]}"
