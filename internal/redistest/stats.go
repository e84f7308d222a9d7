package redistest

import (
	"context"
	"strconv"
	"strings"
)

// CommandStat returns one figure of s's INFO commandstats for cmd ("calls",
// "rejected_calls", ...); 0 when cmd has not been called since the start.
func (s *Server) CommandStat(ctx context.Context, cmd, field string) (int64, error) {
	v, err := s.do(ctx, "INFO", "commandstats")
	if err != nil {
		return 0, err
	}
	info, _ := v.(string)
	_, line, ok := strings.Cut(info, "cmdstat_"+cmd+":")
	if !ok {
		return 0, nil
	}
	line, _, _ = strings.Cut(line, "\r\n")
	for _, kv := range strings.Split(line, ",") {
		if k, v, _ := strings.Cut(kv, "="); k == field {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, nil
}
