#!/bin/sh
# Delete network namespaces left behind by a killed `stalwart bench collectives --netns.hosts N` or
# tests/test_comm_netns.py (they are normally removed on exit). Only touches names Stalwart creates:
# stw<pid>h<host> and stw<pid>sw. Pass a pid to limit it to one run.
set -eu
pattern="^stw${1:-[0-9]*}(h[0-9]+|sw)( |$)"
ip netns list | grep -E "$pattern" | cut -d' ' -f1 | while read -r ns; do
    echo "deleting $ns"
    ip netns del "$ns"
done
