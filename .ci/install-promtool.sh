#!/bin/sh
# Install promtool, which the metrics and alert-rule tests run (`promtool check metrics`, `promtool test
# rules`).  Debian ships it in the `prometheus` package together with the server, whose postinst would
# add a user and start a Prometheus on :9090: only the one static binary is taken out of the package
# (apt-get download + dpkg-deb), into /usr/local/bin.  Idempotent: nothing is fetched when promtool runs.
# Needs root.
set -eu

if command -v promtool >/dev/null 2>&1; then
    echo "install-promtool: ok ($(promtool --version 2>&1 | head -n1))"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-promtool: must run as root" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# apt's own _apt user cannot write a mktemp directory: download as root, no sandbox warning.
download() { apt-get download -o APT::Sandbox::User=root prometheus >/dev/null 2>&1; }
download || { apt-get update -qq && download; }
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool
install -m 0755 usr/bin/promtool /usr/local/bin/promtool
echo "install-promtool: installed ($(/usr/local/bin/promtool --version 2>&1 | head -n1))"
