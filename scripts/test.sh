#!/usr/bin/env bash
# test.sh: the one test command (README, .ci/run). It installs what the tests
# need when it is missing, checks formatting, vet and generated code, then runs
# every test. Long chaos soaks are not part of it (see README).
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server for every store test; ip and iptables for the chaos suite's
# network namespaces and partitions (without them TestChaos skips).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
  echo "test.sh: installing ${missing[*]}" >&2
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq "${missing[@]}" >/dev/null; fi
fi

unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "test.sh: gofmt would change:" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet ./...
# staticcheck, pinned and installed once into GOPATH/bin like the proto tools
# (its own module graph: it adds nothing to go.mod). Settings: staticcheck.conf.
STATICCHECK_VERSION=v0.8.2
staticcheck="$(go env GOPATH)/bin/staticcheck"
if ! "$staticcheck" -version 2>/dev/null | grep -q "(${STATICCHECK_VERSION#v})"; then
  go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"
fi
"$staticcheck" ./...
scripts/proto.sh check
# Every package but the chaos suite, then the chaos suite alone: it runs
# three regions, four allocators and their load on real processes, and its
# Birch check (a small quota sees no denial outside a fault) measures the
# agent's renewal timing, which a concurrent package's tests starving the
# two cores would decide instead (CI, 2026-12-04: two 503s at a window's
# turn in the calm, while other packages' tests shared the cores).
go test -count=1 -timeout 30m $(go list ./... | grep -v '/allot/chaos$')
go test -count=1 -timeout 15m ./chaos
# The pure core and the cluster logic again under the race detector, one
# package at a time: the race detector costs 5-10x the CPU, and the agent's
# time-scheduled scenario (TestNorthstarScenario) once fell 3.7 s behind
# while other packages' race tests shared the two cores.
go test -race -count=1 -p 1 -timeout 20m ./fsm/... ./pkg/...
