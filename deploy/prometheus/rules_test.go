package prometheus

import (
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"

	prom "github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.yaml.in/yaml/v3"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
)

// recorder is a Registerer that keeps the names of the metrics registered
// on it, described without collecting (no node or store needed).
type recorder struct {
	mu    sync.Mutex
	names map[string]bool
}

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *recorder) Register(c prom.Collector) error {
	ch := make(chan *prom.Desc)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	r.mu.Lock()
	defer r.mu.Unlock()
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return nil
}

func (r *recorder) MustRegister(cs ...prom.Collector) {
	for _, c := range cs {
		_ = r.Register(c)
	}
}

func (r *recorder) Unregister(prom.Collector) bool { return true }

// served returns the names of every metric the allocator and an agent
// (with its engine) register.
func served(t *testing.T) map[string]bool {
	t.Helper()
	rec := &recorder{names: map[string]bool{}}
	allocator.NewMetrics(rec)
	doc, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatal(err)
	}
	ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Region = "eu"
	a, err := agent.New(cfg, nil, agent.WithStore(ms), agent.WithRegisterer(rec), agent.WithPolicy(doc, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Engine().Close() })
	// An agent on Redis also serves its client's pool statistics
	// (pkg/agent's TestRedisPoolMetrics shows it registers them).
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialed
	t.Cleanup(func() { rdb.Close() })
	if err := rec.Register(admission.RedisPoolCollector(rdb)); err != nil {
		t.Fatal(err)
	}
	return rec.names
}

type rulesFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// TestAlertRulesNameServedMetrics: every allot_ metric an alert's expression
// names is one the processes serve (a histogram's _bucket, _sum and _count
// included), and every alert has a severity, a summary and a runbook.
func TestAlertRulesNameServedMetrics(t *testing.T) {
	data, err := os.ReadFile("allot-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rf rulesFile
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&rf); err != nil {
		t.Fatalf("allot-alerts.yaml: %v", err)
	}
	names := served(t)
	metric := regexp.MustCompile(`allot_[a-z_]+`)
	alerts := 0
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			alerts++
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["runbook"] == "" {
				t.Errorf("group %s: rule %q lacks an alert name, expr, severity, summary or runbook", g.Name, r.Alert)
			}
			used := metric.FindAllString(r.Expr, -1)
			if len(used) == 0 {
				t.Errorf("%s: names no allot metric", r.Alert)
			}
			for _, m := range used {
				base := m
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if b, ok := strings.CutSuffix(m, suffix); ok && names[b] {
						base = b
					}
				}
				if !names[base] {
					t.Errorf("%s: %s is not a metric the allocator or the agent serves", r.Alert, m)
				}
			}
		}
	}
	if alerts < 5 {
		t.Fatalf("%d alerts read; the file lost its rules", alerts)
	}
}
