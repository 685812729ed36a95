#!/usr/bin/env bash
# A single-node Slurm on localhost, for batchrun's Slurm test: `slurm_local.sh install | up DIR | down DIR`.
#   install  apt-get installs slurmctld, slurmd, slurm-client and munge (Debian packages)
#   up DIR   writes a minimal slurm.conf and a munge key under DIR, starts munged, slurmctld and slurmd
#            (no systemd: the daemons are started directly), waits until the node is idle, and prints
#            `export SLURM_CONF=DIR/slurm.conf` for the caller to eval
#   down DIR stops the daemons by their pid files
set -euo pipefail

cmd=${1:-}
dir=${2:-}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

up() {
  [ -n "$dir" ] || { echo "usage: $0 up DIR" >&2; exit 2; }
  mkdir -p "$dir"/{state,spool,log}
  dir=$(cd "$dir" && pwd)
  # munge runs as user munge, who may not be able to enter DIR: its key, log and seed live in /run
  local m=/run/batchrun-munge
  mkdir -p /run/munge "$m"
  chown munge:munge /run/munge "$m"
  chmod 700 "$m"
  if [ ! -f "$m/munge.key" ]; then
    mungekey --create --keyfile="$m/munge.key" >/dev/null 2>&1 \
      || dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$m/munge.key"
    chmod 400 "$m/munge.key"
  fi
  su -s /bin/sh munge -c "munged --key-file=$m/munge.key --socket=/run/munge/munge.socket.2 \
      --pid-file=$m/munged.pid --log-file=$m/munged.log --seed-file=$m/seed --force"
  # the node's size, as slurmd sees it
  read -r cpus mem < <(slurmd -C | awk '/NodeName/ {for (i=1;i<=NF;i++) {split($i,a,"="); v[a[1]]=a[2]}
                                                    print v["CPUs"], v["RealMemory"]}')
  cat > "$dir/slurm.conf" <<CONF
ClusterName=batchrun-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N localhost
  for _ in $(seq 1 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE 'idle|mixed|allocated'; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm did not come up; logs in $dir/log" >&2
  exit 1
}

down() {
  [ -n "$dir" ] || { echo "usage: $0 down DIR" >&2; exit 2; }
  for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid" /run/batchrun-munge/munged.pid; do
    if [ -f "$pid" ]; then
      kill "$(cat "$pid")" 2>/dev/null || true
    fi
  done
  sleep 0.5
}

case "$cmd" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install | up DIR | down DIR" >&2; exit 2 ;;
esac
