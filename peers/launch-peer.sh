#!/usr/bin/env bash
# Start one p2p-diloco peer from a config file in this folder.
#
#   INITIAL_PEERS=/ip4/198.51.100.1/tcp/31337/p2p/Qm... peers/launch-peer.sh
#   CONFIG=peers/machine-24gb.toml INITIAL_PEERS=/ip4/.../p2p/Qm...,/ip4/.../p2p/Qm... peers/launch-peer.sh --run.run_id c4-400m --run.name=alice
#
# Extra arguments go to `p2p-diloco peer` unchanged (e.g. --section.key=value overrides).
set -euo pipefail

CONFIG="${CONFIG:-$(dirname "$0")/cpu-test.toml}"

if [[ -z "${INITIAL_PEERS:-}" ]]; then
    cat >&2 <<USAGE
usage: INITIAL_PEERS=MADDR[,MADDR...] [CONFIG=peers/FILE.toml] $0 [--section.key=value ...]

  INITIAL_PEERS  multiaddrs of live nodes of the run (a bootstrap node or any peer), comma-separated,
                 e.g. /ip4/198.51.100.1/tcp/31337/p2p/QmXXXX; a bootstrap node prints them at start
  CONFIG         peer config file (default: $(dirname "$0")/cpu-test.toml)
USAGE
    exit 2
fi

exec p2p-diloco peer --config "$CONFIG" --initial-peers "$INITIAL_PEERS" "$@"
