#!/usr/bin/env bash
# Install a SLURM controller + node daemon and munge from Debian's packages, if missing,
# and iproute2 (`ip netns`, veth, bridge) for the two-node cluster in network namespaces.
#
# Used by the SLURM tests (tests/scripts/test_slurm*.py), which start a one-node cluster on
# localhost, or two nodes in network namespaces, with their own slurm.conf; nothing here
# configures or starts a daemon. CI runs
# as root on a fresh Debian machine with package-registry access only, so apt-get is
# enough. Idempotent: a second call with everything present returns at once.
# Exit codes: common/exit_codes.py (2: not root; 1: a package installed but its command missing).
set -euo pipefail

need=()
packages=()
for cmd in sbatch slurmctld slurmd munged; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
[[ ${#need[@]} -gt 0 ]] && packages+=(slurm-wlm munge)
# unshare and nsenter come with util-linux (essential in Debian); ip with iproute2
if ! command -v ip >/dev/null 2>&1; then
    need+=(ip)
    packages+=(iproute2)
fi
if [[ ${#need[@]} -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "error: missing ${need[*]}; installing ${packages[*]} needs root (rerun as root or: sudo $0)" >&2
    exit 2
fi

echo "[setup_slurm] installing ${packages[*]} (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Debian's package postinst scripts try to start the daemons through systemd/invoke-rc.d;
# the tests start them by hand, so a policy-rc.d that refuses service starts keeps the
# install quiet and daemon-free inside containers.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    made_policy=1
fi
trap '[[ $made_policy -eq 1 ]] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
for cmd in sbatch slurmctld slurmd munged ip; do
    command -v "$cmd" >/dev/null 2>&1 || { echo "error: $cmd still missing after installing ${packages[*]}" >&2; exit 1; }
done
echo "[setup_slurm] installed $(slurmctld -V)"
