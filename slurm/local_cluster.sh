#!/usr/bin/env bash
# A single-node Slurm on localhost, for the tests and for trying the submit tool on one machine.
#   bash slurm/local_cluster.sh install   # Debian's slurmctld/slurmd/munge (root; ~10 s)
#   bash slurm/local_cluster.sh start DIR # config, state and logs under DIR; prints the SLURM_CONF to export
#   bash slurm/local_cluster.sh stop DIR
# Settings that matter on a container without systemd or cgroups (proctrack/linuxproc,
# task/none, no accounting) and for fast requeue in tests (short credential expiry, 1 s
# scheduler intervals) follow ../shared/notes/slurm.md.
set -euo pipefail
cmd="${1:-}"
dir="${2:-/tmp/megatron_rl_slurm}"

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 || {
    apt-get update >/dev/null
    apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  }
}

start() {
  mkdir -p "$dir"/{state,spool,log,run}
  local host cpus mem
  host="$(hostname -s)"
  cpus="$(getconf _NPROCESSORS_ONLN)"  # not nproc: it honours OMP_NUM_THREADS
  mem="$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))"
  cat > "$dir/slurm.conf" <<CONF
ClusterName=megatron_rl_local
SlurmctldHost=${host}(127.0.0.1)
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=600
MailProg=/bin/true
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmUser=root
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
CONF
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge: /run/munge
    [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; chown munge: /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    runuser -u munge -- /usr/sbin/munged
  fi
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  # The daemons delete their pid files on exit; keep our own copy to stop them by pid.
  for _ in $(seq 1 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      cat "$dir/run/slurmctld.pid" "$dir/run/slurmd.pid" > "$dir/pids" 2>/dev/null || true
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "local Slurm did not come up; see $dir/log/" >&2
  tail -5 "$dir"/log/*.log >&2 || true
  return 1
}

stop() {
  [ -f "$dir/pids" ] && xargs -r kill < "$dir/pids" 2>/dev/null || true
  rm -f "$dir/pids"
}

case "$cmd" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
