#!/usr/bin/env bash
# What `make demo` and `make test` need from the machine, checked (and, as root with apt, installed).
#
#   deploy/prerequisites.sh demo   Python 3.11 with venv, a Java 17+ JDK, Maven, openssl, Prometheus (promtool)
#   deploy/prerequisites.sh test   the same, plus a Docker engine that answers, debootstrap and docker-compose
#                                  (the container tests build their images locally: docs/containers.md)
#
# Idempotent and quick when everything is there. As root with apt-get, missing Debian packages are
# installed (one `apt-get update` first) and, when no Docker engine answers, dockerd is started in the
# background with --iptables=false and the storage driver $SLUICE_DOCKER_STORAGE_DRIVER, default: overlay2
# if it starts, else vfs (slower, heavier on disk, works everywhere); log in /var/log/sluice-dockerd.log.
# Otherwise it stops at once with one line that names what is missing and the command that installs it.
# SLUICE_NO_CONTAINERS=1 leaves the Docker checks out of the test tier (the container tests then skip).
set -euo pipefail

tier=${1:-test}
case "$tier" in demo|test) ;; *) echo "usage: $0 demo|test" >&2; exit 2 ;; esac
containers=1
[[ "$tier" == test && "${SLUICE_NO_CONTAINERS:-0}" != 1 ]] || containers=0

export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
missing=()    # what is missing, for the message
packages=()   # the Debian packages that install it

need() {  # need <what> <debian package> <test command...>
  local what=$1 package=$2
  shift 2
  if ! "$@" >/dev/null 2>&1; then
    missing+=("$what")
    [[ " ${packages[*]} " == *" $package "* ]] || packages+=("$package")
  fi
}

check() {
  missing=() packages=()
  need make make command -v make
  need python3.11 python3 command -v python3
  need python3-venv python3-venv python3 -c 'import ensurepip, venv'
  need java openjdk-17-jdk-headless command -v java
  need javac openjdk-17-jdk-headless command -v javac   # the secure devstack runs ApplyAcls.java as a source file
  need mvn maven command -v mvn
  need openssl openssl command -v openssl
  need promtool prometheus command -v promtool
  need prometheus prometheus command -v prometheus
  if ((containers)); then
    need dockerd docker.io command -v dockerd
    need docker docker.io command -v docker
    need debootstrap debootstrap command -v debootstrap
    need docker-compose docker-compose compose_available
  fi
}

compose_available() {
  command -v docker-compose || docker compose version
}

engine_answers() {
  timeout 10 docker info >/dev/null 2>&1
}

check
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "prerequisites: installing ${packages[*]} (for ${missing[*]})" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
    check
  fi
  if ((${#missing[@]})); then
    sudo=""; [[ $(id -u) == 0 ]] || sudo="sudo "
    echo "prerequisites: missing ${missing[*]}; install with: ${sudo}apt-get install -y --no-install-recommends ${packages[*]}" >&2
    exit 1
  fi
fi

if ((containers)) && ! engine_answers; then
  if [[ $(id -u) != 0 ]]; then
    if [[ -S /var/run/docker.sock ]]; then
      echo "prerequisites: the Docker engine refuses $(id -un); add the user to the docker group (sudo usermod -aG docker $(id -un)) or run as root" >&2
    else
      echo "prerequisites: no Docker engine answers; start one: sudo dockerd --storage-driver=vfs --iptables=false &  (or SLUICE_NO_CONTAINERS=1 to skip the container tests)" >&2
    fi
    exit 1
  fi
  log=/var/log/sluice-dockerd.log
  { : >>"$log"; } 2>/dev/null || log="${XDG_STATE_HOME:-$HOME/.local/state}/sluice/dockerd.log"
  mkdir -p "$(dirname "$log")"
  # overlay2 where the kernel and file system allow it (builds about twice as fast), else vfs
  drivers=${SLUICE_DOCKER_STORAGE_DRIVER:-overlay2 vfs}
  for driver in $drivers; do
    echo "prerequisites: starting dockerd --storage-driver=$driver --iptables=false (log $log)" >&2
    setsid nohup dockerd --storage-driver="$driver" --iptables=false >>"$log" 2>&1 </dev/null &
    pid=$!
    deadline=$((SECONDS + 60))
    while ((SECONDS < deadline)); do
      engine_answers && break 2
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if ! engine_answers; then
    echo "prerequisites: dockerd did not start (tried: $drivers); see $log: $(grep -E 'failed to start daemon|level=fatal' "$log" | tail -n 1)" >&2
    exit 1
  fi
fi
