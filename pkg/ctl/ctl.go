// Package ctl is allotctl, the operator CLI: policy publish/get/list/diff, the
// stated bound, window ledgers and cluster membership. Output is a table for
// people, or JSON (-o json) for scripts. cmd/allotctl only calls Main.
package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http/httptrace"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

const usage = `usage: allotctl [-addr host:port,...] [-o table|json] [-timeout 10s] COMMAND

commands:
  policy publish FILE -author WHO -reason WHY [-version N]   publish FILE as version N (default current+1)
  policy get [N | -version N]                                 print policy version N (default current)
  policy list                                                 the audit history, newest first
  policy diff FILE [-version N]                               rule-level diff of a version (default current) against FILE
  bound [QUOTA]                                               the stated overshoot bound per global quota
  window QUOTA [-index N]                                     the ledger of a quota's window (default current)
  cluster                                                     leader, members and Raft indexes
  member add ID RAFT_ADDR API_ADDR                            add a voter
  member remove ID                                            remove a member

The allocator addresses come from -addr or $ALLOT_ADDR (default 127.0.0.1:8001).
Global flags go before the command.
`

// ErrUsage is matched (errors.Is) by the errors of a command line allotctl
// cannot run: a flag or argument missing, malformed or unexpected.
// cmd/allotctl exits 2 on them.
var ErrUsage = errors.New("usage error")

// usageError is an error of the command line. shown: Main printed the
// usage with it.
type usageError struct {
	msg   string
	shown bool
}

func (e *usageError) Error() string        { return e.msg }
func (e *usageError) Is(target error) bool { return target == ErrUsage }

// usagef is the usage error of format and args.
func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// UsageShown reports whether Main printed the usage along with usage
// error err; otherwise cmd/allotctl points to -h after the error.
func UsageShown(err error) bool {
	var u *usageError
	return errors.As(err, &u) && u.shown
}

// shown marks usage error err as printed with the usage.
func shown(err error) error {
	var u *usageError
	if errors.As(err, &u) {
		u.shown = true
	}
	return err
}

// quiet makes fs print nothing itself: the flag package would print a
// flag error and the whole usage before Parse returns the error, which
// cmd/allotctl then prints again. parse prints the usage on -h only.
func quiet(fs *flag.FlagSet) *flag.FlagSet {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses args with fs (quiet), printing the usage to stderr on -h.
func parse(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stderr, usage)
	}
	return err
}

// Main runs allotctl with args (without the program name). It returns
// flag.ErrHelp after printing the usage for -h, and an ErrUsage error for
// a command line it cannot run.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := quiet(flag.NewFlagSet("allotctl", flag.ContinueOnError))
	defAddr := os.Getenv("ALLOT_ADDR")
	if defAddr == "" {
		defAddr = "127.0.0.1:8001"
	}
	addr := fs.String("addr", defAddr, "comma-separated allocator API addresses")
	output := fs.String("o", "table", "output format: table or json")
	timeout := fs.Duration("timeout", 10*time.Second, "timeout of the call")
	if err := parse(fs, args, stderr); err != nil {
		return flagError("", err)
	}
	if *output != "table" && *output != "json" {
		return usagef("-o: %q is neither table nor json", *output)
	}
	if *timeout <= 0 {
		return usagef("-timeout must be positive, got %s", *timeout)
	}
	endpoints, err := parseAddrs(*addr)
	if err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		fmt.Fprint(stderr, usage)
		return shown(usagef("no command"))
	}
	client, err := allocator.NewClient(endpoints)
	if err != nil {
		return err
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := &cli{op: client.Operator(), out: stdout, errOut: stderr, json: *output == "json"}
	switch rest[0] {
	case "policy":
		return c.policy(ctx, rest[1:])
	case "bound":
		return c.bound(ctx, rest[1:])
	case "window":
		return c.window(ctx, rest[1:])
	case "cluster":
		return c.cluster(ctx, rest[1:])
	case "member":
		return c.member(ctx, rest[1:])
	default:
		fmt.Fprint(stderr, usage)
		return shown(usagef("unknown command %q", rest[0]))
	}
}

// parseAddrs checks -addr's comma-separated allocator addresses: each
// host:port or an http:// or https:// URL (allocator.NewClient puts
// http:// before a host:port).
func parseAddrs(list string) ([]string, error) {
	addrs := strings.Split(list, ",")
	given := false
	for i, a := range addrs {
		addrs[i] = strings.TrimSpace(a)
		given = given || addrs[i] != ""
	}
	if !given {
		return nil, usagef("-addr: no address given")
	}
	for i, a := range addrs {
		switch {
		case a == "":
			return nil, usagef("-addr: address %d of %d is empty", i+1, len(addrs))
		case strings.HasPrefix(a, "http://") || strings.HasPrefix(a, "https://"):
			if u, err := url.Parse(a); err != nil || u.Host == "" {
				return nil, usagef("-addr: %q is not a URL with a host", a)
			}
		default:
			if err := allocator.CheckDialAddr(a); err != nil {
				return nil, usagef("-addr: %q is not host:port (%v)", a, err)
			}
		}
	}
	return addrs, nil
}

type cli struct {
	op     *allocator.OperatorClient
	out    io.Writer
	errOut io.Writer // flag errors and -h
	json   bool
}

// flags returns the flag set of command cmd ("window", "policy get").
func (c *cli) flags(cmd string) *flag.FlagSet {
	return quiet(flag.NewFlagSet(cmd, flag.ContinueOnError))
}

// flagError is the error of a flag set's Parse for command cmd ("" for
// the global flags): flag.ErrHelp as is, others usage errors. A flag cmd
// does not take gets the hint that global flags go before the command.
func flagError(cmd string, err error) error {
	switch name, undefined := strings.CutPrefix(err.Error(), "flag provided but not defined: "); {
	case errors.Is(err, flag.ErrHelp):
		return err
	case cmd == "":
		return usagef("%v", err)
	case undefined:
		return unexpected(cmd, name)
	default:
		return usagef("%s: %v", cmd, err)
	}
}

// unexpected is the usage error of an argument cmd does not take; a flag
// gets the hint that global flags go before the command.
func unexpected(cmd, arg string) error {
	if !strings.HasPrefix(arg, "-") {
		return usagef("%s: unexpected argument %q", cmd, arg)
	}
	name, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
	switch name {
	case "addr", "o", "timeout":
		return usagef("%s: unexpected argument %q: global flags go before the command (allotctl -%s ... %s ...)", cmd, arg, name, cmd)
	}
	return usagef("%s: unexpected argument %q (global flags -addr, -o and -timeout go before the command)", cmd, arg)
}

// wantArgs checks that cmd's positional arguments pos are those named,
// no fewer and no more.
func wantArgs(cmd string, pos []string, names ...string) error {
	if len(pos) < len(names) {
		return usagef("%s: missing %s", cmd, strings.Join(names[len(pos):], " "))
	}
	if len(pos) > len(names) {
		return unexpected(cmd, pos[len(names)])
	}
	return nil
}

func (c *cli) emitJSON(m proto.Message) error {
	b, err := protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(c.out, string(b))
	return err
}

func (c *cli) table(header string, rows [][]string) error {
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

// parseFlags parses sub-command flags that may come after positional args.
func (c *cli) parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for len(args) > 0 {
		if err := parse(fs, args, c.errOut); err != nil {
			return nil, flagError(fs.Name(), err)
		}
		args = fs.Args()
		if len(args) > 0 {
			pos = append(pos, args[0])
			args = args[1:]
		}
	}
	return pos, nil
}

func (c *cli) policy(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usagef("policy: want publish, get, list or diff")
	}
	cmd := "policy " + args[0]
	fs := c.flags(cmd)
	var author, reason *string
	version := new(uint64)
	switch args[0] {
	case "publish":
		author = fs.String("author", os.Getenv("USER"), "who publishes (audit)")
		reason = fs.String("reason", "", "why (audit)")
		version = fs.Uint64("version", 0, "policy version")
	case "get", "diff":
		version = fs.Uint64("version", 0, "policy version")
	case "list":
	default:
		return usagef("policy: unknown sub-command %q (want publish, get, list or diff)", args[0])
	}
	pos, err := c.parseFlags(fs, args[1:])
	if err != nil {
		return err
	}
	switch args[0] {
	case "publish":
		if err := wantArgs(cmd, pos, "FILE"); err != nil {
			return err
		}
		doc, err := os.ReadFile(pos[0])
		if err != nil {
			return err
		}
		if _, err := policy.Parse(doc); err != nil { // fail before the network
			return fmt.Errorf("%s: %w", pos[0], err)
		}
		v := *version
		if v == 0 {
			cur, err := c.op.GetPolicy(ctx, &allotv1.GetPolicyRequest{})
			switch {
			case err == nil:
				v = cur.GetPolicy().GetVersion() + 1
			case strings.Contains(err.Error(), "not_found"):
				v = 1
			default:
				return err
			}
		}
		resp, err := c.op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: doc, ExpectedVersion: v, Author: *author, Reason: *reason})
		if err != nil {
			return err
		}
		if c.json {
			return c.emitJSON(resp)
		}
		p := resp.GetPolicy()
		_, err = fmt.Fprintf(c.out, "published version %d (digest %s) by %s: %s\n", p.GetVersion(), p.GetDigest()[:12], p.GetAuthor(), p.GetReason())
		return err
	case "get":
		if len(pos) > 0 { // policy get N
			if err := wantArgs(cmd, pos, "N"); err != nil {
				return err
			}
			n, err := strconv.ParseUint(pos[0], 10, 64)
			if err != nil {
				return usagef("%s: unexpected argument %q (want a version number)", cmd, pos[0])
			}
			if n == 0 {
				return usagef("%s: no version 0: versions start at 1 (without N, the current version)", cmd)
			}
			flagged := false
			fs.Visit(func(f *flag.Flag) { flagged = flagged || f.Name == "version" })
			if flagged {
				return usagef("%s: version given twice (%s and -version %d)", cmd, pos[0], *version)
			}
			*version = n
		}
		resp, err := c.policyVersion(ctx, cmd, *version)
		if err != nil {
			return err
		}
		if c.json {
			return c.emitJSON(resp)
		}
		p := resp.GetPolicy()
		fmt.Fprintf(c.out, "# version %d by %s at %s: %s\n# digest %s\n", p.GetVersion(), p.GetAuthor(),
			time.UnixMilli(p.GetPublishedUnixMs()).UTC().Format(time.RFC3339), p.GetReason(), p.GetDigest())
		var pretty any
		if err := json.Unmarshal(p.GetDocument(), &pretty); err != nil {
			_, err = c.out.Write(p.GetDocument())
			return err
		}
		enc := json.NewEncoder(c.out)
		enc.SetIndent("", "  ")
		return enc.Encode(pretty)
	case "list":
		if err := wantArgs(cmd, pos); err != nil {
			return err
		}
		resp, err := c.op.ListPolicies(ctx, &allotv1.ListPoliciesRequest{})
		if err != nil {
			return err
		}
		if c.json {
			return c.emitJSON(resp)
		}
		var rows [][]string
		for _, p := range resp.GetPolicies() {
			rows = append(rows, []string{fmt.Sprint(p.GetVersion()), time.UnixMilli(p.GetPublishedUnixMs()).UTC().Format(time.RFC3339),
				p.GetAuthor(), p.GetDigest()[:12], p.GetReason()})
		}
		return c.table("VERSION\tPUBLISHED\tAUTHOR\tDIGEST\tREASON", rows)
	case "diff":
		if err := wantArgs(cmd, pos, "FILE"); err != nil {
			return err
		}
		text, err := os.ReadFile(pos[0])
		if err != nil {
			return err
		}
		next, err := policy.Parse(text)
		if err != nil {
			return fmt.Errorf("%s: %w", pos[0], err)
		}
		resp, err := c.policyVersion(ctx, cmd, *version)
		if err != nil {
			return err
		}
		cur, err := policy.Parse(resp.GetPolicy().GetDocument())
		if err != nil {
			return fmt.Errorf("stored version %d: %w", resp.GetPolicy().GetVersion(), err)
		}
		changes := policy.Diff(cur, next)
		if c.json {
			enc := json.NewEncoder(c.out)
			enc.SetIndent("", "  ")
			return enc.Encode(changes)
		}
		if len(changes) == 0 {
			_, err = fmt.Fprintf(c.out, "no changes against version %d\n", resp.GetPolicy().GetVersion())
			return err
		}
		fmt.Fprintf(c.out, "changes from version %d to %s:\n", resp.GetPolicy().GetVersion(), pos[0])
		for _, ch := range changes {
			fmt.Fprintf(c.out, "  %s\n", ch)
		}
		return nil
	}
	return nil // not reached: args[0] was checked above
}

// policyVersion returns policy version v (0: the current one) for command
// cmd. The allocator answers NotFound "not retained" for any version it
// does not hold: one past the current version was never published.
func (c *cli) policyVersion(ctx context.Context, cmd string, v uint64) (*allotv1.GetPolicyResponse, error) {
	resp, err := c.op.GetPolicy(ctx, &allotv1.GetPolicyRequest{Version: v})
	if err == nil || v == 0 || connect.CodeOf(err) != connect.CodeNotFound {
		return resp, err
	}
	cur, cerr := c.op.GetPolicy(ctx, &allotv1.GetPolicyRequest{})
	switch {
	case connect.CodeOf(cerr) == connect.CodeNotFound:
		return nil, fmt.Errorf("%s: version %d was never published: no policy has been published yet", cmd, v)
	case cerr != nil:
		return nil, err
	case v > cur.GetPolicy().GetVersion():
		return nil, fmt.Errorf("%s: version %d was never published (the current version is %d)", cmd, v, cur.GetPolicy().GetVersion())
	}
	return nil, fmt.Errorf("%s: %w (see allotctl policy list)", cmd, err)
}

func (c *cli) bound(ctx context.Context, args []string) error {
	pos, err := c.parseFlags(c.flags("bound"), args)
	if err != nil {
		return err
	}
	req := &allotv1.GetBoundRequest{}
	if len(pos) > 0 {
		if err := wantArgs("bound", pos, "QUOTA"); err != nil {
			return err
		}
		req.Quota = pos[0]
	}
	resp, err := c.op.GetBound(ctx, req)
	if err != nil {
		return err
	}
	if c.json {
		return c.emitJSON(resp)
	}
	fmt.Fprintf(c.out, "policy version %d\n", resp.GetPolicyVersion())
	for _, b := range resp.GetBounds() {
		parked := ""
		if n := b.GetStrandedParkedTokens(); n > 0 {
			parked = fmt.Sprintf("; %d parked in gateways' in-process chunks", n)
		}
		fmt.Fprintf(c.out, "\n%s: G=%d per %s; admitted per window <= %d (overshoot %d); stranded up to %d (%s)%s\n",
			b.GetQuota(), b.GetLimit(), time.Duration(b.GetWindowMs())*time.Millisecond, b.GetMaxAdmittedPerWindow(),
			b.GetOvershoot(), b.GetStrandedTokens(), b.GetStrandedAssumption(), parked)
		var rows [][]string
		for _, t := range b.GetTerms() {
			rows = append(rows, []string{t.GetName(), fmt.Sprint(t.GetTokens()), t.GetAssumption(), t.GetHowToZero()})
		}
		if err := c.table("TERM\tTOKENS\tASSUMPTION\tHOW TO MAKE IT 0", rows); err != nil {
			return err
		}
	}
	return nil
}

func (c *cli) window(ctx context.Context, args []string) error {
	fs := c.flags("window")
	index := fs.Int64("index", 0, "window index (default current)")
	pos, err := c.parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs("window", pos, "QUOTA"); err != nil {
		return err
	}
	resp, err := c.op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: pos[0], WindowIndex: *index})
	if err != nil {
		return c.windowNotFound(ctx, pos[0], *index, err)
	}
	if c.json {
		return c.emitJSON(resp)
	}
	fmt.Fprintf(c.out, "%s window %d [%s, %s): limit %d granted %d released %d expired %d remaining %d\n",
		resp.GetQuota(), resp.GetWindowIndex(),
		clock(resp.GetWindowStartUnixMs()), clock(resp.GetWindowEndUnixMs()),
		resp.GetLimit(), resp.GetGranted(), resp.GetReleased(), resp.GetExpired(), resp.GetRemaining())
	if n := resp.GetCarried(); n > 0 {
		// Grants of pools a publish reset whose leases reach this window,
		// expired or not: without this line remaining would not add up.
		fmt.Fprintf(c.out, "carried %d (grants from before a window change or re-add whose leases reach this window; the pool leaves room for them)\n", n)
	}
	var rows [][]string
	for _, r := range resp.GetRegions() {
		rows = append(rows, []string{r.GetRegion(), fmt.Sprint(r.GetGrants()), fmt.Sprint(r.GetGranted()), fmt.Sprint(r.GetReleased()),
			fmt.Sprint(r.GetHeld()), fmt.Sprint(r.GetExpired()), fmt.Sprintf("%.1f", r.GetDemandPerSecond())})
	}
	return c.table("REGION\tGRANTS\tGRANTED\tRELEASED\tHELD\tEXPIRED\tDEMAND/S", rows)
}

// windowNotFound is the error of window's GetWindow(quota, index) that
// failed with err. The allocator retains the previous window's ledger (and
// the next one's, once pre-granted from) but keeps none of a window nobody
// was granted from, and answers NotFound "not retained" for it: for the
// previous and the next window, the error says it had no grants instead.
func (c *cli) windowNotFound(ctx context.Context, quota string, index int64, err error) error {
	if index == 0 || connect.CodeOf(err) != connect.CodeNotFound {
		return err
	}
	cur, cerr := c.op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: quota})
	if cerr != nil {
		return err
	}
	length := cur.GetWindowEndUnixMs() - cur.GetWindowStartUnixMs()
	var which, had string
	switch index - cur.GetWindowIndex() {
	case -1:
		which, had = "the previous window", "had no grants"
	case 1:
		which, had = "the next window", "has no grants yet"
	default:
		return err
	}
	start := cur.GetWindowStartUnixMs() + (index-cur.GetWindowIndex())*length
	return fmt.Errorf("window: %s window %d (%s, [%s, %s)) %s: the allocator keeps no ledger of a window nobody was granted from",
		quota, index, which, clock(start), clock(start+length), had)
}

// clock formats a window bound as window's table does.
func clock(unixMs int64) string { return time.UnixMilli(unixMs).UTC().Format("15:04:05.000") }

func (c *cli) cluster(ctx context.Context, args []string) error {
	pos, err := c.parseFlags(c.flags("cluster"), args)
	if err != nil {
		return err
	}
	if err := wantArgs("cluster", pos); err != nil {
		return err
	}
	resp, err := c.op.GetCluster(ctx, &allotv1.GetClusterRequest{})
	if err != nil {
		return err
	}
	if c.json {
		return c.emitJSON(resp)
	}
	fmt.Fprintf(c.out, "answered by %s (%s), term %d, last %d, commit %d, applied %d, policy v%d\n",
		resp.GetNodeId(), resp.GetState(), resp.GetTerm(), resp.GetLastLogIndex(), resp.GetCommitIndex(), resp.GetAppliedIndex(), resp.GetPolicyVersion())
	if id := resp.GetClusterId(); id != "" {
		fmt.Fprintf(c.out, "cluster %s\n", id)
	}
	return c.members(resp.GetMembers())
}

func (c *cli) members(ms []*allotv1.Member) error {
	var rows [][]string
	for _, m := range ms {
		lead := ""
		if m.GetLeader() {
			lead = "*"
		}
		rows = append(rows, []string{m.GetId(), lead, m.GetSuffrage(), m.GetRaftAddress(), m.GetApiAddress()})
	}
	return c.table("ID\tLEADER\tSUFFRAGE\tRAFT\tAPI", rows)
}

func (c *cli) member(ctx context.Context, args []string) error {
	const want = "want 'add ID RAFT_ADDR API_ADDR' or 'remove ID'"
	if len(args) == 0 {
		return usagef("member: %s", want)
	}
	cmd := "member " + args[0]
	var names []string
	switch args[0] {
	case "add":
		names = []string{"ID", "RAFT_ADDR", "API_ADDR"}
	case "remove":
		names = []string{"ID"}
	default:
		return usagef("member: unknown sub-command %q (%s)", args[0], want)
	}
	pos, err := c.parseFlags(c.flags(cmd), args[1:])
	if err != nil {
		return err
	}
	if err := wantArgs(cmd, pos, names...); err != nil {
		return err
	}
	if pos[0] == "" {
		return usagef("%s: ID is empty", cmd)
	}
	// A voter whose address is unusable can cost the cluster its quorum:
	// refuse it here, before the allocator.
	for i, name := range names[1:] {
		if err := allocator.CheckDialAddr(pos[1+i]); err != nil {
			return usagef("%s: %s %q is not host:port (%v)", cmd, name, pos[1+i], err)
		}
	}
	// sent: a request was written, so a call that failed after it may have
	// been applied all the same.
	var sent atomic.Bool
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteHeaders: func() { sent.Store(true) }})
	var ms []*allotv1.Member
	var resp proto.Message
	if args[0] == "add" {
		r, err := c.op.AddMember(ctx, &allotv1.AddMemberRequest{Id: pos[0], RaftAddress: pos[1], ApiAddress: pos[2]})
		if err != nil {
			return maybeApplied(cmd, sent.Load(), err)
		}
		resp, ms = r, r.GetMembers()
	} else {
		r, err := c.op.RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: pos[0]})
		if err != nil {
			return maybeApplied(cmd, sent.Load(), err)
		}
		resp, ms = r, r.GetMembers()
	}
	if c.json {
		return c.emitJSON(resp)
	}
	return c.members(ms)
}

// maybeApplied is the error of membership change cmd: one whose answer did
// not come (unavailable, past the deadline, cancelled) after it was sent
// may have been committed all the same.
func maybeApplied(cmd string, sent bool, err error) error {
	if !sent {
		return err
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled:
	default:
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return fmt.Errorf("%s: %w; the change may or may not have been applied: check with `allotctl cluster`", cmd, err)
}
