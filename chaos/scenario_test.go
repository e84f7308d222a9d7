package chaos

import "testing"

// TestCountDropped reads the packet counters of tagged DROP rules from the
// output of `iptables -L -v -x -n` (the format of iptables 1.8, nf_tables),
// which partition-region and cut-allocators use to prove their cut took
// effect.
func TestCountDropped(t *testing.T) {
	out := `Chain INPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination         
      17     1020 DROP       0    --  *      *       10.77.0.21           0.0.0.0/0            /* chaos-cut */
       4      240 DROP       0    --  *      *       10.77.0.22           0.0.0.0/0            /* chaos-cut */
       9      540 DROP       0    --  *      *       10.77.0.23           0.0.0.0/0            /* chaos-partition */

Chain FORWARD (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination         

Chain OUTPUT (policy ACCEPT 52 packets, 3120 bytes)
    pkts      bytes target     prot opt in     out     source               destination         
       0        0 DROP       0    --  *      *       0.0.0.0/0            10.77.0.21           /* chaos-cut */
     100     6000 ACCEPT     0    --  *      *       0.0.0.0/0            10.77.0.22           /* chaos-cut */
`
	if got := countDropped(out, "chaos-cut"); got != 21 {
		t.Errorf("chaos-cut: %d packets dropped, want 21 (17 + 4 + 0; the ACCEPT rule does not count)", got)
	}
	if got := countDropped(out, "chaos-partition"); got != 9 {
		t.Errorf("chaos-partition: %d packets dropped, want 9", got)
	}
	if got := countDropped(out, "chaos-isolate"); got != 0 {
		t.Errorf("chaos-isolate (no rule): %d packets dropped, want 0", got)
	}
}
