#!/bin/sh
# Install what the systemd-nspawn test tier (tests/nspawn/) needs on a
# Debian/Ubuntu host.  Idempotent: does nothing (no apt-get update either)
# when everything is already there.  Needs root.
#
#   systemd-container  systemd-nspawn (pulls in systemd itself: the container
#                      boots the host's /lib/systemd/systemd)
#   util-linux         nsenter, mount/umount, setpriv (Essential on Debian)
#   iproute2           `ip` inside the container for network debugging
#                      (optional; the harness does not need it)
set -eu

if [ "$(id -u)" -ne 0 ]; then
    echo "install-systemd-tier: must run as root" >&2
    exit 1
fi

need=""
command -v systemd-nspawn >/dev/null 2>&1 || need="$need systemd-container"
[ -x /lib/systemd/systemd ] || [ -x /usr/lib/systemd/systemd ] || need="$need systemd"
for tool in nsenter setpriv mount umount; do
    command -v "$tool" >/dev/null 2>&1 || { need="$need util-linux mount"; break; }
done
command -v ip >/dev/null 2>&1 || need="$need iproute2"

if [ -n "$need" ]; then
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086  # word splitting of $need is intended
    echo "install-systemd-tier: installing:$need"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

# Sanity: overlayfs must be available for the harness (module may be loadable).
if ! grep -qw overlay /proc/filesystems; then
    modprobe overlay 2>/dev/null || true
fi
grep -qw overlay /proc/filesystems || {
    echo "install-systemd-tier: overlayfs not available in this kernel" >&2
    exit 1
}

echo "install-systemd-tier: ok ($(systemd-nspawn --version | head -n1))"
