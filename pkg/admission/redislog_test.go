package admission_test

import (
	"context"
	"fmt"
	"log"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

// stderrRedisLog stands in for go-redis's default logger, which cannot be
// read back, once a test has replaced it.
type stderrRedisLog struct{}

func (stderrRedisLog) Printf(_ context.Context, format string, v ...any) {
	log.Print("redis: " + fmt.Sprintf(format, v...))
}

// TestRedisLog: with RedisLog installed, go-redis's message about a failed
// dial arrives in the zap logger as a warning marked component=go-redis.
func TestRedisLog(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	redis.SetLogger(admission.RedisLog{Logger: zap.New(core)})
	t.Cleanup(func() { redis.SetLogger(stderrRedisLog{}) })
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	if err := c.Ping(context.Background()).Err(); err == nil {
		t.Fatal("ping of a closed port succeeded")
	}
	var found bool
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "dial") && e.Level == zapcore.WarnLevel && e.ContextMap()["component"] == "go-redis" {
			found = true
		}
	}
	if !found {
		t.Fatalf("no go-redis warning about the dial among %d entries: %v", logs.Len(), logs.All())
	}
}
