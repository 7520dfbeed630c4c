#!/usr/bin/env bash
# One torchrun per node, configured by environment variables. Extra arguments go to `ddptrain train`.
#
#   scripts/launch.sh [train|doctor] [ddptrain flags ...]
#
# Static rendezvous (the seed's way: every node knows the head node and its own rank):
#   NNODES          number of nodes (default 1)
#   NPROC_PER_NODE  workers per node (default: number of GPUs, else 1)
#   NODE_RANK       this node's rank, 0..NNODES-1 (default: SLURM_NODEID, else 0)
#   MASTER_ADDR     address of node 0 (required when NNODES > 1; one node without it runs --standalone)
#   MASTER_PORT     port of the job's store on node 0 (default 29500)
#
# c10d rendezvous (elastic: nodes may join, leave and restart; ranks are assigned at rendezvous):
#   RDZV_ENDPOINT   host:port of the rendezvous store; setting it selects this mode
#   RDZV_ID         job id shared by all nodes (default: SLURM_JOB_ID, else "ddptrain")
#   NNODES          N, or MIN:MAX to keep training on fewer nodes after one is lost
#   MAX_RESTARTS    times the workers are restarted (re-rendezvous, resume from the newest checkpoint)
#   RDZV_CONF       extra rendezvous settings, e.g. "join_timeout=900,last_call_timeout=30"
#
# Both modes:
#   LOCAL_ADDR      the address other nodes reach this node at (torchrun --local-addr). Set it when the
#                   hostname resolves to the wrong interface; in c10d mode the node whose LOCAL_ADDR is the
#                   RDZV_ENDPOINT host hosts the rendezvous store.
#   PYTHON          interpreter with ddptrain installed (default: python3)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the workers get after a signal to commit the preemption
#                   checkpoint before they are killed (default 60; keep it under SLURM's --signal lead)
#   LAUNCH_DRY_RUN=1  print the torchrun command instead of running it
#
# torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 to the workers, which save a checkpoint at
# the next step boundary, write RUN_DIR/PREEMPTED and exit 75. This script execs torchrun, so a signal
# sent to it (by SLURM, Kubernetes or kill) reaches the agent exactly once.
set -euo pipefail

die() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

command=train
if [[ ${1:-} == train || ${1:-} == doctor ]]; then
    command=$1
    shift
fi

PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-60}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ $NPROC_PER_NODE -gt 0 ]] || NPROC_PER_NODE=1
fi

is_uint "$NPROC_PER_NODE" && [[ $NPROC_PER_NODE -ge 1 ]] ||
    die "NPROC_PER_NODE=$NPROC_PER_NODE: give the number of workers per node (usually its GPU count)"
is_uint "$MAX_RESTARTS" || die "MAX_RESTARTS=$MAX_RESTARTS: give a number of restarts (0 = none)"
is_uint "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" ||
    die "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT: give whole seconds"

args=(--nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
      --signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
[[ -n ${LOCAL_ADDR:-} ]] && args+=(--local-addr "$LOCAL_ADDR")

if [[ -n ${RDZV_ENDPOINT:-} ]]; then
    [[ $NNODES =~ ^[0-9]+(:[0-9]+)?$ ]] || die "NNODES=$NNODES: give N or MIN:MAX (e.g. 1:4)"
    [[ $RDZV_ENDPOINT == *:* ]] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT: give host:port of the rendezvous store"
    rdzv_conf=${RDZV_CONF:-}
    # torch decides who hosts the store by hostname; with an address endpoint, LOCAL_ADDR settles it.
    if [[ -n ${LOCAL_ADDR:-} && ${RDZV_ENDPOINT%:*} == "$LOCAL_ADDR" && $rdzv_conf != *is_host=* ]]; then
        rdzv_conf=${rdzv_conf:+$rdzv_conf,}is_host=1
    fi
    # Restarted workers reading a previous round's keys from the agent's shared store fail to connect
    # (pytorch/pytorch#135712): let each round's rank 0 host a fresh store, as `ddptrain train --nproc` does.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
    args+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
           --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-ddptrain}}")
    [[ -n $rdzv_conf ]] && args+=(--rdzv-conf "$rdzv_conf")
else
    is_uint "$NNODES" && [[ $NNODES -ge 1 ]] ||
        die "NNODES=$NNODES: static rendezvous needs a fixed node count; for MIN:MAX set RDZV_ENDPOINT (c10d)"
    if [[ $NNODES -eq 1 && -z ${MASTER_ADDR:-} ]]; then
        args+=(--standalone)  # one node: a private store on a free port
    else
        [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES needs MASTER_ADDR, the address of node 0"
        NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
        is_uint "$NODE_RANK" && [[ $NODE_RANK -lt $NNODES ]] ||
            die "NODE_RANK=$NODE_RANK: give this node's rank, 0..$((NNODES - 1))"
        args+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
               --master-port "${MASTER_PORT:-29500}")
    fi
fi

cmd=("$PYTHON" -m torch.distributed.run "${args[@]}" -m ddptrain "$command" "$@")
if [[ ${LAUNCH_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
