package admission

import (
	"context"
	"fmt"
	"strings"

	"go.uber.org/zap"
)

// RedisLog carries go-redis's own messages (a failed dial, a pool closing a
// bad connection, a Sentinel naming a new primary) into a zap logger, at
// warning level and marked component=go-redis. go-redis's logger is one per
// process: install it with redis.SetLogger(admission.RedisLog{Logger: l})
// where the process builds its logger, so that those messages join the
// structured log instead of going to stderr as plain lines.
type RedisLog struct {
	Logger *zap.Logger
}

// Printf logs one go-redis message.
func (r RedisLog) Printf(_ context.Context, format string, v ...any) {
	r.Logger.Warn(strings.TrimSpace(fmt.Sprintf(format, v...)), zap.String("component", "go-redis"))
}
