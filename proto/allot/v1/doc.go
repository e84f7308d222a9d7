// Package allotv1 holds the messages of allot's API and their gRPC stubs,
// generated from the .proto files beside it (admission.proto: the region
// agent's Check, CheckBatch and ReleaseSlot; allocator.proto: Acquire and
// Release; operator.proto: policies and their watch, bounds, windows and
// the cluster). The Connect handlers and clients are in allotv1connect.
// Edit the .proto files and run scripts/proto.sh; this file is the only one
// here written by hand.
package allotv1
