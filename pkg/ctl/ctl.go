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
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

const usage = `usage: allotctl [-addr host:port,...] [-o table|json] [-timeout 10s] COMMAND

commands:
  policy publish FILE -author WHO -reason WHY [-version N]   publish FILE as version N (default current+1)
  policy get [-version N]                                     print a policy version (default current)
  policy list                                                 the audit history, newest first
  policy diff FILE [-version N]                               rule-level diff of a version (default current) against FILE
  bound [QUOTA]                                               the stated overshoot bound per global quota
  window QUOTA [-index N]                                     the ledger of a quota's window (default current)
  cluster                                                     leader, members and Raft indexes
  member add ID RAFT_ADDR API_ADDR                            add a voter
  member remove ID                                            remove a member

The allocator addresses come from -addr or $ALLOT_ADDR (default 127.0.0.1:8001).
`

// Main runs allotctl with args (without the program name).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("allotctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }
	defAddr := os.Getenv("ALLOT_ADDR")
	if defAddr == "" {
		defAddr = "127.0.0.1:8001"
	}
	addr := fs.String("addr", defAddr, "comma-separated allocator API addresses")
	output := fs.String("o", "table", "output format: table or json")
	timeout := fs.Duration("timeout", 10*time.Second, "timeout of the call")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *output != "table" && *output != "json" {
		return fmt.Errorf("-o: %q is neither table nor json", *output)
	}
	rest := fs.Args()
	if len(rest) == 0 {
		fs.Usage()
		return errors.New("no command")
	}
	client, err := allocator.NewClient(strings.Split(*addr, ","))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := &cli{op: client.Operator(), out: stdout, json: *output == "json"}
	switch rest[0] {
	case "policy":
		return c.policy(ctx, rest[1:])
	case "bound":
		return c.bound(ctx, rest[1:])
	case "window":
		return c.window(ctx, rest[1:])
	case "cluster":
		return c.cluster(ctx)
	case "member":
		return c.member(ctx, rest[1:])
	default:
		fs.Usage()
		return fmt.Errorf("unknown command %q", rest[0])
	}
}

type cli struct {
	op   *allocator.OperatorClient
	out  io.Writer
	json bool
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
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for len(args) > 0 {
		if err := fs.Parse(args); err != nil {
			return nil, err
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
		return errors.New("policy: want publish, get, list or diff")
	}
	fs := flag.NewFlagSet("policy "+args[0], flag.ContinueOnError)
	author := fs.String("author", os.Getenv("USER"), "who publishes (audit)")
	reason := fs.String("reason", "", "why (audit)")
	version := fs.Uint64("version", 0, "policy version")
	pos, err := parseFlags(fs, args[1:])
	if err != nil {
		return err
	}
	switch args[0] {
	case "publish":
		if len(pos) != 1 {
			return errors.New("policy publish: want exactly one FILE")
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
		resp, err := c.op.GetPolicy(ctx, &allotv1.GetPolicyRequest{Version: *version})
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
		if len(pos) != 1 {
			return errors.New("policy diff: want exactly one FILE")
		}
		text, err := os.ReadFile(pos[0])
		if err != nil {
			return err
		}
		next, err := policy.Parse(text)
		if err != nil {
			return fmt.Errorf("%s: %w", pos[0], err)
		}
		resp, err := c.op.GetPolicy(ctx, &allotv1.GetPolicyRequest{Version: *version})
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
	default:
		return fmt.Errorf("policy: unknown sub-command %q", args[0])
	}
}

func (c *cli) bound(ctx context.Context, args []string) error {
	req := &allotv1.GetBoundRequest{}
	if len(args) > 0 {
		req.Quota = args[0]
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
		fmt.Fprintf(c.out, "\n%s: G=%d per %s; admitted per window <= %d (overshoot %d); stranded up to %d (%s)\n",
			b.GetQuota(), b.GetLimit(), time.Duration(b.GetWindowMs())*time.Millisecond, b.GetMaxAdmittedPerWindow(),
			b.GetOvershoot(), b.GetStrandedTokens(), b.GetStrandedAssumption())
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
	fs := flag.NewFlagSet("window", flag.ContinueOnError)
	index := fs.Int64("index", 0, "window index (default current)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("window: want exactly one QUOTA")
	}
	resp, err := c.op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: pos[0], WindowIndex: *index})
	if err != nil {
		return err
	}
	if c.json {
		return c.emitJSON(resp)
	}
	fmt.Fprintf(c.out, "%s window %d [%s, %s): limit %d granted %d released %d expired %d remaining %d\n",
		resp.GetQuota(), resp.GetWindowIndex(),
		time.UnixMilli(resp.GetWindowStartUnixMs()).UTC().Format("15:04:05.000"),
		time.UnixMilli(resp.GetWindowEndUnixMs()).UTC().Format("15:04:05.000"),
		resp.GetLimit(), resp.GetGranted(), resp.GetReleased(), resp.GetExpired(), resp.GetRemaining())
	var rows [][]string
	for _, r := range resp.GetRegions() {
		rows = append(rows, []string{r.GetRegion(), fmt.Sprint(r.GetGrants()), fmt.Sprint(r.GetGranted()), fmt.Sprint(r.GetReleased()),
			fmt.Sprint(r.GetHeld()), fmt.Sprint(r.GetExpired()), fmt.Sprintf("%.1f", r.GetDemandPerSecond())})
	}
	return c.table("REGION\tGRANTS\tGRANTED\tRELEASED\tHELD\tEXPIRED\tDEMAND/S", rows)
}

func (c *cli) cluster(ctx context.Context) error {
	resp, err := c.op.GetCluster(ctx, &allotv1.GetClusterRequest{})
	if err != nil {
		return err
	}
	if c.json {
		return c.emitJSON(resp)
	}
	fmt.Fprintf(c.out, "answered by %s (%s), term %d, last %d, commit %d, applied %d, policy v%d\n",
		resp.GetNodeId(), resp.GetState(), resp.GetTerm(), resp.GetLastLogIndex(), resp.GetCommitIndex(), resp.GetAppliedIndex(), resp.GetPolicyVersion())
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
	switch {
	case len(args) == 4 && args[0] == "add":
		resp, err := c.op.AddMember(ctx, &allotv1.AddMemberRequest{Id: args[1], RaftAddress: args[2], ApiAddress: args[3]})
		if err != nil {
			return err
		}
		if c.json {
			return c.emitJSON(resp)
		}
		return c.members(resp.GetMembers())
	case len(args) == 2 && args[0] == "remove":
		resp, err := c.op.RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: args[1]})
		if err != nil {
			return err
		}
		if c.json {
			return c.emitJSON(resp)
		}
		return c.members(resp.GetMembers())
	}
	return errors.New("member: want 'add ID RAFT_ADDR API_ADDR' or 'remove ID'")
}
