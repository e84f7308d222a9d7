#!/usr/bin/env bash
# proto.sh: lint the protos and (re)generate the committed Go + Connect code with
# local plugins only. `scripts/proto.sh check` fails when the committed code is
# stale. The tools are installed into $(go env GOPATH)/bin once and reused.
set -euo pipefail
cd "$(dirname "$0")/.."

BUF_VERSION=v1.75.0
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_CONNECT_GO_VERSION=v1.19.1
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

bin="$(go env GOPATH)/bin"
export PATH="$bin:$PATH"

need() { # need TOOL VERSION MODULE
  if ! "$bin/$1" --version 2>/dev/null | grep -q "${2#v}"; then
    echo "proto.sh: installing $1 $2 (buf takes minutes the first time)" >&2
    go install "$3@$2"
  fi
}
need buf "$BUF_VERSION" github.com/bufbuild/buf/cmd/buf
need protoc-gen-go "$PROTOC_GEN_GO_VERSION" google.golang.org/protobuf/cmd/protoc-gen-go
need protoc-gen-connect-go "$PROTOC_GEN_CONNECT_GO_VERSION" connectrpc.com/connect/cmd/protoc-gen-connect-go
need protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION" google.golang.org/grpc/cmd/protoc-gen-go-grpc

buf lint

case "${1:-generate}" in
generate)
  buf generate
  ;;
check)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  buf generate -o "$tmp"
  # doc.go: the hand-written package comments beside the generated code.
  if ! diff -r -q --exclude='*.proto' --exclude=doc.go "$tmp/proto" proto >/dev/null; then
    diff -r --exclude='*.proto' --exclude=doc.go "$tmp/proto" proto | head -40 >&2 || true
    echo "proto.sh: generated code is stale: run scripts/proto.sh and commit the result" >&2
    exit 1
  fi
  echo "proto.sh: generated code is up to date"
  ;;
*)
  echo "usage: scripts/proto.sh [generate|check]" >&2
  exit 2
  ;;
esac
