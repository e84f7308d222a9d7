package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"runtime"
	"strings"
	"time"

	"connectrpc.com/connect"
	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/checkclient"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// The agent suite: the region agent's two APIs beside the engine's raw
// script ceiling, in one run on one Redis (issue 4).
//
//	raw      (a)  the admission script through go-redis, one EVALSHA per decision
//	connect  (c)  the agent's Check over Connect (HTTP/2 cleartext, binary protobuf)
//	connect-batch (cb) the same Check calls through pkg/checkclient, which
//	              coalesces concurrent callers' checks into CheckBatch calls
//	              (one coalescing client on one HTTP/2 connection)
//	connect-http1 (c') the same over HTTP/1.1 keep-alive connections, one per
//	              concurrent caller: how gateways with a connection pool call it
//	connect-lean (cl) the same requests on the same HTTP/1.1 listener from a
//	              lean load generator (leanH1: prepared request bytes, one
//	              write and one read per call, as wrk drives a server): the
//	              agent's Connect server without the CPU of Go's HTTP client
//	connect-lean-h2 (cl2) the same requests on the same listener over
//	              cleartext HTTP/2 from a lean multiplexing generator (leanH2,
//	              as h2load drives a server: -connections connections)
//	connect-grpc (c'') the same Connect client with connect.WithGRPC() against
//	              the agent's gRPC listener, where grpc-go's transport serves
//	              AdmissionService (agent.GRPCAdmissionService)
//	grpc-connect (c°) a grpc-go client against the Connect handler (the
//	              listener of (c), gRPC protocol over h2c): the Connect server
//	              with a lighter load generator than connect-go's client
//	grpc     (c*) AdmissionService.Check from a grpc-go client on that listener
//	envoy    (d)  the agent's Envoy RLS endpoint (gRPC ShouldRateLimit)
//	envoy-lean (dl) the same ShouldRateLimit calls from the lean HTTP/2
//	              generator speaking gRPC, a client as light as Envoy's own
//
// The agent runs in this process on its own listeners, deciding the same
// requests (one token bucket per user, 100 tenants) as the raw mode, so (c)
// and (d) pay for the wire, the handler and the engine on top of the script.
// The load generator, the agent and Redis share the machine.

// AgentModes lists the agent suite's modes in the order it runs them.
func AgentModes() []string {
	return []string{"raw", "connect", "connect-batch", "connect-http1", "connect-lean", "connect-lean-h2", "connect-grpc", "grpc-connect", "grpc", "envoy", "envoy-lean"}
}

// AgentSuiteConfig configures the agent suite.
type AgentSuiteConfig struct {
	// Modes to run, from AgentModes().
	Modes []string
	// Workers is the number of concurrent callers.
	Workers int
	// Keys is the number of distinct counters (users) requests spread over.
	Keys int
	// Requests and Duration bound each mode.
	Requests int64
	Duration time.Duration
	// Warmup runs before each measurement.
	Warmup time.Duration
	// Connections is how many HTTP/2 connections the Connect and gRPC
	// clients spread their callers over.
	Connections int
	// Redis configures the agent's store and batcher; the default is the
	// agent's (agent.DefaultStoreConfig).
	Redis admission.RedisConfig
}

// DefaultAgentSuiteConfig returns 64 callers over 10,000 keys and 4
// connections, 10 s or 3 million calls per mode after 1 s of warmup.
func DefaultAgentSuiteConfig() AgentSuiteConfig {
	return AgentSuiteConfig{
		Modes: AgentModes(), Workers: 64, Keys: 10_000, Requests: 3_000_000, Duration: 10 * time.Second,
		Warmup: time.Second, Connections: 4, Redis: agent.DefaultStoreConfig(),
	}
}

// Validate says what is wrong with c, or returns nil.
func (c AgentSuiteConfig) Validate() error {
	errs := checkModesAndKeys(c.Modes, AgentModes(), c.Keys)
	if c.Connections < 1 || c.Connections > 256 {
		errs = append(errs, fmt.Errorf("Connections must be in [1, 256], got %d", c.Connections))
	}
	if err := (Config{Workers: c.Workers, Requests: c.Requests, Duration: c.Duration, Warmup: c.Warmup}).Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Redis.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// RunAgentSuite runs the agent suite against client, printing each figure
// to out as it is measured.
func RunAgentSuite(ctx context.Context, client redis.UniversalClient, cfg AgentSuiteConfig, out io.Writer) ([]Figure, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	doc, err := policy.Parse([]byte(onePolicy))
	if err != nil {
		return nil, err
	}
	acfg := agent.DefaultConfig()
	acfg.Region = "bench"
	acfg.Engine.Namespace = "benchag"
	acfg.Engine.StoreTimeout = time.Second // measure the store, not the fail modes
	acfg.Engine.ExtraDescriptors = []string{"route"}
	acfg.Store = cfg.Redis
	acfg.DecisionLogSample = 0
	a, err := agent.New(acfg, client, agent.WithPolicy(doc, 0))
	if err != nil {
		return nil, err
	}
	actx, stopAgent := context.WithCancel(ctx)
	agentDone := make(chan error, 1)
	go func() { agentDone <- a.Run(actx) }()
	defer func() {
		stopAgent()
		<-agentDone
	}()

	reqs := requests(cfg.Keys)
	// As in RunSuite, (a)'s prepared calls live only until (a) has run, so
	// the GC cycles of the agent's modes do not mark them.
	lastRaw := lastIndex(cfg.Modes, "raw")
	var calls []admission.ScriptCall
	if lastRaw >= 0 {
		if calls, err = scriptCalls(a.Engine(), reqs); err != nil {
			return nil, err
		}
	}
	checks := make([]*allotv1.CheckRequest, len(reqs))
	rls := make([]*rlsv3.RateLimitRequest, len(reqs))
	for i, r := range reqs {
		cr := &allotv1.CheckRequest{}
		rr := &rlsv3.RateLimitRequest{Domain: "bench", Descriptors: []*commonrl.RateLimitDescriptor{{}}}
		for _, e := range r.Descriptors {
			cr.Entries = append(cr.Entries, &allotv1.DescriptorEntry{Key: e.Key, Value: e.Value})
			rr.Descriptors[0].Entries = append(rr.Descriptors[0].Entries, &commonrl.RateLimitDescriptor_Entry{Key: e.Key, Value: e.Value})
		}
		checks[i], rls[i] = cr, rr
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	gln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		ln.Close()
		return nil, err
	}
	sctx, stopServe := context.WithCancel(context.Background())
	served := make(chan struct{}, 2)
	go func() {
		srv := allocator.HTTPServer(ln.Addr().String(), agent.Mux(a, nil))
		_ = allocator.Serve(sctx, srv, ln, time.Second)
		_ = srv.Close()
		served <- struct{}{}
	}()
	gs := agent.NewGRPCServer(a)
	go func() {
		_ = gs.Serve(gln)
		served <- struct{}{}
	}()
	defer func() {
		stopServe()
		gs.Stop()
		<-served
		<-served
	}()
	connectClients := make([]allotv1connect.AdmissionServiceClient, cfg.Connections)
	h1 := http1Client(cfg.Workers)
	defer h1.CloseIdleConnections()
	h1Client := allotv1connect.NewAdmissionServiceClient(h1, "http://"+ln.Addr().String())
	rlsClients := make([]rlsv3.RateLimitServiceClient, cfg.Connections)
	viaGRPC := make([]allotv1connect.AdmissionServiceClient, cfg.Connections)
	grpcClients := make([]allotv1.AdmissionServiceClient, cfg.Connections)
	grpcToConnect := make([]allotv1.AdmissionServiceClient, cfg.Connections)
	for i := range connectClients {
		hc := h2cClient() // one client, one HTTP/2 connection
		defer hc.CloseIdleConnections()
		connectClients[i] = allotv1connect.NewAdmissionServiceClient(hc, "http://"+ln.Addr().String())
		conn, err := grpc.NewClient(gln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		rlsClients[i] = rlsv3.NewRateLimitServiceClient(conn)
		grpcClients[i] = allotv1.NewAdmissionServiceClient(conn)
		cconn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer cconn.Close()
		grpcToConnect[i] = allotv1.NewAdmissionServiceClient(cconn)
		viaGRPC[i] = allotv1connect.NewAdmissionServiceClient(hc, "http://"+gln.Addr().String(), connect.WithGRPC())
	}

	sha := admission.ScriptSHA()
	base := Config{Workers: cfg.Workers, Requests: cfg.Requests, Duration: cfg.Duration, Warmup: cfg.Warmup}
	var figs []Figure
	for mi, mode := range cfg.Modes {
		if mi > lastRaw && calls != nil {
			calls = nil
			runtime.GC()
		}
		c := base
		var target Target
		switch mode {
		case "raw":
			c.Name = "(a) raw, 1 call/decision"
			target = func(ctx context.Context, w int, i uint64) error {
				k := calls[keyOf(w, i, len(calls))]
				return client.EvalSha(ctx, sha, k.Keys, k.Args...).Err()
			}
		case "connect":
			c.Name = "(c) agent Check, Connect"
			target = checkTarget(checks, func(w int) allotv1connect.AdmissionServiceClient { return connectClients[w%len(connectClients)] })
		case "connect-batch":
			c.Name = "(cb) agent Check, Connect batching"
			// One coalescing client, as a gateway process would have: its
			// batches are largest when every caller shares it.
			batching, err := checkclient.New(connectClients[0], checkclient.Config{})
			if err != nil {
				return figs, err
			}
			defer batching.Close()
			target = checkTarget(checks, func(int) allotv1connect.AdmissionServiceClient { return batching })
		case "connect-http1":
			c.Name = "(c') agent Check, Connect h1"
			target = checkTarget(checks, func(int) allotv1connect.AdmissionServiceClient { return h1Client })
		case "connect-lean":
			c.Name = "(cl) agent Check, Connect h1, lean generator"
			lean, err := newLeanH1(ln.Addr().String(), checks, cfg.Workers)
			if err != nil {
				return figs, err
			}
			defer lean.close()
			target = lean.target()
		case "connect-lean-h2":
			c.Name = "(cl2) agent Check, Connect h2c, lean generator"
			msgs, err := marshalAll(checks)
			if err != nil {
				return figs, err
			}
			lean := newLeanH2(ln.Addr().String(), allotv1connect.AdmissionServiceCheckProcedure, false, msgs, cfg.Workers, cfg.Connections, checkResponses(cfg.Workers))
			defer lean.close()
			target = lean.target()
		case "connect-grpc":
			c.Name = "(c'') agent Check, Connect gRPC"
			target = checkTarget(checks, func(w int) allotv1connect.AdmissionServiceClient { return viaGRPC[w%len(viaGRPC)] })
		case "grpc-connect":
			c.Name = "(c°) agent Check, Connect server, grpc-go client"
			target = grpcCheckTarget(checks, grpcToConnect)
		case "grpc":
			c.Name = "(c*) agent Check, grpc-go"
			target = grpcCheckTarget(checks, grpcClients)
		case "envoy":
			c.Name = "(d) agent Envoy RLS, gRPC"
			target = func(ctx context.Context, w int, i uint64) error {
				resp, err := rlsClients[w%len(rlsClients)].ShouldRateLimit(ctx, rls[keyOf(w, i, len(rls))])
				switch {
				case err != nil:
					return err
				case resp.GetOverallCode() != rlsv3.RateLimitResponse_OK:
					return fmt.Errorf("code %s", resp.GetOverallCode())
				}
				return nil
			}
		case "envoy-lean":
			c.Name = "(dl) agent Envoy RLS, gRPC, lean generator"
			msgs, err := marshalAll(rls)
			if err != nil {
				return figs, err
			}
			resps := make([]rlsv3.RateLimitResponse, cfg.Workers)
			lean := newLeanH2(gln.Addr().String(), rlsv3.RateLimitService_ShouldRateLimit_FullMethodName, true, msgs, cfg.Workers, cfg.Connections,
				func(w int, b []byte) error {
					m := &resps[w]
					m.Reset()
					if err := proto.Unmarshal(b, m); err != nil {
						return err
					}
					if m.GetOverallCode() != rlsv3.RateLimitResponse_OK {
						return fmt.Errorf("code %s", m.GetOverallCode())
					}
					return nil
				})
			defer lean.close()
			target = lean.target()
		}
		f, err := measure(ctx, client, c, target)
		if err != nil {
			return figs, fmt.Errorf("%s: %w", mode, err)
		}
		figs = append(figs, f)
		fmt.Fprintln(out, f)
	}
	return figs, nil
}

// marshalAll marshals every message, for generators that send prepared
// bytes.
func marshalAll[M proto.Message](msgs []M) ([][]byte, error) {
	out := make([][]byte, len(msgs))
	for i, m := range msgs {
		b, err := proto.Marshal(m)
		if err != nil {
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}

// checkResponses returns a check of Check responses for a lean generator:
// worker w decodes into its own message; a denial is an error.
func checkResponses(workers int) func(w int, b []byte) error {
	resps := make([]allotv1.CheckResponse, workers)
	return func(w int, b []byte) error {
		m := &resps[w]
		m.Reset()
		if err := proto.Unmarshal(b, m); err != nil {
			return err
		}
		if !m.Allowed {
			return refusal(m)
		}
		return nil
	}
}

// checkTarget sends Check requests through the Connect client worker w
// uses; a denial is an error (the suite's requests are always allowed).
func checkTarget(checks []*allotv1.CheckRequest, client func(w int) allotv1connect.AdmissionServiceClient) Target {
	return func(ctx context.Context, w int, i uint64) error {
		resp, err := client(w).Check(ctx, connect.NewRequest(checks[keyOf(w, i, len(checks))]))
		switch {
		case err != nil:
			return err
		case !resp.Msg.Allowed:
			return refusal(resp.Msg)
		}
		return nil
	}
}

// grpcCheckTarget sends Check requests through grpc-go client stubs, one
// per connection; a denial is an error.
func grpcCheckTarget(checks []*allotv1.CheckRequest, clients []allotv1.AdmissionServiceClient) Target {
	return func(ctx context.Context, w int, i uint64) error {
		resp, err := clients[w%len(clients)].Check(ctx, checks[keyOf(w, i, len(checks))])
		switch {
		case err != nil:
			return err
		case !resp.Allowed:
			return refusal(resp)
		}
		return nil
	}
}

// http1Client returns a client speaking only HTTP/1.1 that keeps up to conns
// connections open to one host.
func http1Client(conns int) *http.Client {
	var p http.Protocols
	p.SetHTTP1(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p, MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns}}
}

// h2cClient returns a client speaking only cleartext HTTP/2 (prior
// knowledge), so callers multiplex on one connection as gRPC's do. (A
// transport allowing HTTP/1.1 too picks HTTP/1.1 for http:// URLs.)
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// SummarizeAgent prints every (c) variant and (d) as fractions of (a); the
// agent issue targets at least 0.5 each. Each is compared with the (a)
// measured nearest before and after it (their mean when both ran, with how
// far apart they were), so that a run with (a) between the modes
// (Bracket) is judged against the machine as it was around each mode.
func SummarizeAgent(out io.Writer, figs []Figure) {
	fmt.Fprintln(out, "summary:")
	for i, f := range figs {
		if !strings.HasPrefix(f.Name, "(c") && !strings.HasPrefix(f.Name, "(d") {
			continue
		}
		var before, after float64
		for j := i - 1; j >= 0 && before == 0; j-- {
			if strings.HasPrefix(figs[j].Name, "(a) ") {
				before = figs[j].PerSecond
			}
		}
		for j := i + 1; j < len(figs) && after == 0; j++ {
			if strings.HasPrefix(figs[j].Name, "(a) ") {
				after = figs[j].PerSecond
			}
		}
		switch {
		case before > 0 && after > 0:
			a := (before + after) / 2
			fmt.Fprintf(out, "  %s / (a): %.2f (target >= 0.5; (a) %.0f/s before, %.0f/s after: %.0f%% apart)\n",
				f.Name, f.PerSecond/a, before, after, 100*math.Abs(before-after)/a)
		case before > 0 || after > 0:
			fmt.Fprintf(out, "  %s / (a): %.2f (target >= 0.5)\n", f.Name, f.PerSecond/(before+after))
		}
	}
}

// Bracket returns modes with raw before the first and after each of the
// others, so that every mode's (a) is measured next to it; the machine's
// speed drifts while a suite runs when other work shares it.
func Bracket(modes []string) []string {
	out := []string{"raw"}
	for _, m := range modes {
		if m != "raw" {
			out = append(out, m, "raw")
		}
	}
	return out
}

// refusal describes a Check that did not allow: a denial, or the rule's
// fail mode answering because the store could not decide in time.
func refusal(r *allotv1.CheckResponse) error {
	if r.GetUnavailable() {
		return fmt.Errorf("unavailable: rule %s could not be decided (decision %s)", r.GetRule(), r.GetDecisionId())
	}
	return fmt.Errorf("denied by %s (remaining %d, retry after %ds, decision %s)", r.GetRule(), r.GetRemaining(), r.GetRetryAfterSeconds(), r.GetDecisionId())
}
