#!/usr/bin/env bash
# run.sh: the main job. Starts allot's local multi-region topology (see
# deploy/multiregion) and prints a table per window. Flags pass through, e.g.
#   ./scripts/run.sh -windows 0 -keep      # run until Ctrl-C
# The binary is built first and then runs in this script's place, so every
# signal (Ctrl-C, SIGTERM, a closed terminal's SIGHUP) reaches it and it
# stops what it started; `go run` would forward only SIGINT and SIGQUIT.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${TMPDIR:-/tmp}/allot-multiregion-$(id -u)"
go build -o "$bin" ./deploy/multiregion
exec "$bin" "$@"
