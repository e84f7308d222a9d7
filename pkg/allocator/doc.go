// Package allocator is allot's allocator server: one Raft node (hashicorp/raft
// with a BoltDB log and stable store, file snapshots and a TCP transport)
// whose state machine is fsm.FSM, and the Connect handlers of
// allot.v1.AllocatorService and allot.v1.OperatorService on top of it.
//
// The leader stamps its clock into every entry and answers a call only after
// the entry is committed by a quorum and applied, so no acknowledged grant is
// lost by a failover. Concurrent Acquire and Release calls are group-committed
// into one entry. Any node accepts any call: followers forward to the leader
// once, and answer Unavailable with a LeaderHint when they cannot. Client is
// the matching failover client; Run wires a node, its HTTP server (Connect,
// gRPC and gRPC-Web over h2c, /metrics, /healthz, /readyz) and a graceful
// shutdown that transfers leadership first. With RunOptions.GRPCAddr it
// also serves AllocatorService on grpc-go (NewGRPCServer), which costs
// callers and the node about half the CPU per call of net/http's HTTP/2;
// Client sends Acquire and Release there with WithGRPCEndpoints.
//
// Membership changes keep the quorum: AddMember adds a non-voter and
// promotes it only once it has caught up (else it stays a non-voter and a
// retry promotes it), and RemoveMember refuses to remove a voter unless a
// quorum of the voters left answer.
//
// # Usage
//
//  1. Build a Config from DefaultConfig and flags; Validate it.
//  2. Call Run (processes), or NewNode + NewServer + Mux + HTTPServer (tests,
//     embedding), injecting stores and a transport with WithRaftDeps if needed;
//     register Server.Shutdown with the HTTP server's RegisterOnShutdown, as
//     Run does, so open WatchPolicy streams do not hold a graceful shutdown.
//  3. Publish a policy (OperatorService.PublishPolicy) before regions Acquire.
//  4. Stop with a cancelled context (Run) or Node.Close: both transfer
//     leadership first when other voters exist.
package allocator
