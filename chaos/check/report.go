package check

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/allot-dev/allot/chaos/history"
)

// Row is one line of the report table: one quota during one scenario.
type Row struct {
	// Scenario is the scenario's name ("calm" for windows outside every fault).
	Scenario string
	// Quota is the quota.
	Quota string
	// Windows is how many windows the scenario touched.
	Windows int
	// MaxAdmitted is the most admitted in one of them, by the true clock;
	// MaxOffered the most offered (Window.Offered) in one of them.
	MaxAdmitted, MaxOffered int64
	// G and Bound are the limit and the stated overshoot.
	G, Bound int64
	// Violations counts violations of every check located in those windows.
	Violations int
	// StrandedPct is the tokens of those windows' grants that expired
	// unspent, as a percentage of G x windows.
	StrandedPct float64
	// Recovery is the scenario's time to recover (see Result.Recovery).
	Recovery time.Duration
	// Note says why a scenario did not run, or that it did not recover.
	Note string
}

// Table builds the report rows: one per scenario span and quota, then one
// "calm" row per quota for the windows outside every span. grace extends
// each span past its end, like the Birch check.
func Table(h history.History, r *Result, quotas []Quota, grace time.Duration) []Row {
	var rows []Row
	inSpan := map[string]map[int64]bool{}
	for i, s := range h.Spans {
		for _, q := range quotas {
			row := Row{Scenario: s.Scenario, Quota: q.Name, G: q.Limit, Bound: q.Bound, Note: s.Skipped}
			if i < len(r.Recovery) {
				row.Recovery = r.Recovery[i]
			}
			if s.Skipped == "" && row.Recovery < 0 {
				row.Note = "not recovered before the end"
			}
			if s.Skipped == "" {
				set := map[int64]bool{}
				for _, w := range r.Windows[q.Name] {
					if touches(s, w, grace) {
						set[w.Index] = true
					}
				}
				if inSpan[q.Name] == nil {
					inSpan[q.Name] = map[int64]bool{}
				}
				for w := range set {
					inSpan[q.Name][w] = true
				}
				fill(&row, r, q, set)
			}
			rows = append(rows, row)
		}
	}
	for _, q := range quotas {
		set := map[int64]bool{}
		for _, w := range r.Windows[q.Name] {
			if !inSpan[q.Name][w.Index] && w.Admitted > 0 {
				set[w.Index] = true
			}
		}
		row := Row{Scenario: "calm", Quota: q.Name, G: q.Limit, Bound: q.Bound, Recovery: -2}
		fill(&row, r, q, set)
		rows = append(rows, row)
	}
	return rows
}

func fill(row *Row, r *Result, q Quota, set map[int64]bool) {
	var stranded int64
	for _, w := range r.Windows[q.Name] {
		if !set[w.Index] {
			continue
		}
		row.Windows++
		row.MaxAdmitted = max(row.MaxAdmitted, w.Admitted)
		row.MaxOffered = max(row.MaxOffered, w.Offered())
		stranded += w.Stranded
	}
	for _, v := range r.Violations {
		if v.Quota == q.Name && set[v.Window] {
			row.Violations++
		}
	}
	if row.Windows > 0 && q.Limit > 0 {
		row.StrandedPct = float64(stranded) * 100 / float64(q.Limit*int64(row.Windows))
	}
}

// Render writes the table, the per-quota summary and every violation.
func Render(w io.Writer, title string, h history.History, r *Result, quotas []Quota, grace time.Duration) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n", title)
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tquota\twindows\tmax offered\tmax admitted\tG\tbound\tviolations\tstranded %\trecovery\t")
	for _, row := range Table(h, r, quotas, grace) {
		rec := "-"
		switch {
		case row.Note != "":
			rec = row.Note
		case row.Recovery >= 0:
			rec = row.Recovery.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%.1f\t%s\t\n", row.Scenario, row.Quota, row.Windows, row.MaxOffered, row.MaxAdmitted, row.G, row.Bound, row.Violations, row.StrandedPct, rec)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	b.WriteString("\n")
	for _, q := range quotas {
		fmt.Fprintf(&b, "%s\n", MeasureLoad(h, r, q, grace))
		if q.FallbackPerRegion > 0 {
			fmt.Fprintf(&b, "%s\n", MeasureFallback(h, r, q, grace))
		}
	}
	fmt.Fprintf(&b, "grants received %d, replays checked %d, ledger reads %d, acquires never answered %d, ledger grants no region knows %d, admissions answered as replays %d, by a fail mode (degraded) %d\n",
		r.Grants, r.Replays, r.LedgerReads, r.Unresolved, r.Unclaimed, r.ReplayedAdmissions, r.DegradedAdmissions)
	fmt.Fprintf(&b, "deposit deadlines checked %d, deposits of unknown outcome %d (%d of them in a fault of their store), fallback allowances journaled %d (%d tokens added)\n",
		r.DepositsChecked, r.DepositsUnknown, r.DepositsExcused, r.Fallbacks, r.FallbackTokens)
	names := make([]string, 0, len(r.Linearizability))
	for n := range r.Linearizability {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		l := r.Linearizability[n]
		verdict := "linearizable"
		if len(l.Illegal) > 0 {
			verdict = fmt.Sprintf("NOT linearizable in windows %v", l.Illegal)
		}
		if len(l.Unknown) > 0 {
			verdict += fmt.Sprintf(", undecided (timeout) in windows %v", l.Unknown)
		}
		fmt.Fprintf(&b, "porcupine %s: %d windows, %d operations, slowest window %s: %s\n", n, l.Windows, l.Ops, l.Longest.Round(time.Millisecond), verdict)
	}
	var counts []string
	for _, c := range Checks {
		counts = append(counts, fmt.Sprintf("%s %d", c, r.Count(c)))
	}
	fmt.Fprintf(&b, "violations: %s\n", strings.Join(counts, ", "))
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "\n%s\n", v)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
