package allocator

import (
	"testing"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestHCLogFormatsValues checks that the adapter renders hclog.Fmt (raft
// logs configurations with it) and hclog's number types as hclog does,
// not as the slices and ints they are.
func TestHCLogFormatsValues(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	l := newHCLog(zap.New(core), "raft").With("implied", hclog.Fmt("%d/%d", 1, 2))
	type server struct{ ID, Address string }
	l.Info("configuration", "servers", hclog.Fmt("%+v", []server{{"a1", "127.0.0.1:7001"}}),
		"hex", hclog.Hex(17), "octal", hclog.Octal(8), "binary", hclog.Binary(5), "quote", hclog.Quote("a\nb"),
		"plain", 3, "bad format", hclog.Format{42}, "empty", hclog.Format{}, hclog.Fmt("%s", "odd"))
	entries := logs.All()
	if len(entries) != 1 {
		t.Fatalf("%d entries, want 1", len(entries))
	}
	got := entries[0].ContextMap()
	want := map[string]any{
		"implied": "1/2",
		"servers": "[{ID:a1 Address:127.0.0.1:7001}]",
		"hex":     "0x11", "octal": "010", "binary": "0b101", "quote": "a\nb",
		"plain": int64(3), "bad format": "42", "empty": "", "extra": "odd",
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s = %#v, want %#v", k, got[k], w)
		}
	}
}
