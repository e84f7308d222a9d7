#!/usr/bin/env bash
# run.sh: the main job. Starts allot's local multi-region topology (see
# deploy/multiregion) and prints a table per window. Flags pass through, e.g.
#   ./scripts/run.sh -windows 0 -keep      # run until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./deploy/multiregion "$@"
