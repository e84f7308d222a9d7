package allocator

import (
	"fmt"
	"io"
	"log"
	"strconv"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// hclogAdapter lets hashicorp/raft log through the node's zap logger, so there
// is one log stream per process and no global logger.
type hclogAdapter struct {
	z       *zap.Logger
	name    string
	implied []interface{}
	level   hclog.Level
}

var _ hclog.Logger = (*hclogAdapter)(nil)

func newHCLog(z *zap.Logger, name string) *hclogAdapter {
	lvl := hclog.Info
	if z.Core().Enabled(zapcore.DebugLevel) {
		lvl = hclog.Debug
	}
	return &hclogAdapter{z: z.Named(name), name: name, level: lvl}
}

func (l *hclogAdapter) fields(args []interface{}) []zap.Field {
	all := append(append([]interface{}{}, l.implied...), args...)
	fs := make([]zap.Field, 0, len(all)/2+1)
	for i := 0; i < len(all); i += 2 {
		key, ok := all[i].(string)
		if !ok {
			key = "arg"
		}
		if i+1 < len(all) {
			fs = append(fs, zap.Any(key, hclogValue(all[i+1])))
		} else {
			fs = append(fs, zap.Any("extra", hclogValue(all[i])))
		}
	}
	return fs
}

// hclogValue renders hclog's formatting types as hclog's own text output
// does: hclog.Fmt("%+v", x) is a Format, whose first element is the format
// string (zap would otherwise log the slice itself, ["%+v",[…]]).
func hclogValue(v interface{}) interface{} {
	switch v := v.(type) {
	case hclog.Format:
		if len(v) == 0 {
			return ""
		}
		if f, ok := v[0].(string); ok {
			return fmt.Sprintf(f, v[1:]...)
		}
		return fmt.Sprint(v...)
	case hclog.Hex:
		return "0x" + strconv.FormatInt(int64(v), 16)
	case hclog.Octal:
		return "0" + strconv.FormatInt(int64(v), 8)
	case hclog.Binary:
		return "0b" + strconv.FormatInt(int64(v), 2)
	case hclog.Quote:
		return string(v)
	}
	return v
}

func (l *hclogAdapter) Log(level hclog.Level, msg string, args ...interface{}) {
	if level < l.level || level == hclog.Off {
		return
	}
	switch {
	case level <= hclog.Debug:
		l.z.Debug(msg, l.fields(args)...)
	case level == hclog.Info:
		l.z.Info(msg, l.fields(args)...)
	case level == hclog.Warn:
		l.z.Warn(msg, l.fields(args)...)
	default:
		l.z.Error(msg, l.fields(args)...)
	}
}

func (l *hclogAdapter) Trace(msg string, args ...interface{}) { l.Log(hclog.Trace, msg, args...) }
func (l *hclogAdapter) Debug(msg string, args ...interface{}) { l.Log(hclog.Debug, msg, args...) }
func (l *hclogAdapter) Info(msg string, args ...interface{})  { l.Log(hclog.Info, msg, args...) }
func (l *hclogAdapter) Warn(msg string, args ...interface{})  { l.Log(hclog.Warn, msg, args...) }
func (l *hclogAdapter) Error(msg string, args ...interface{}) { l.Log(hclog.Error, msg, args...) }
func (l *hclogAdapter) IsTrace() bool                         { return l.level <= hclog.Trace }
func (l *hclogAdapter) IsDebug() bool                         { return l.level <= hclog.Debug }
func (l *hclogAdapter) IsInfo() bool                          { return l.level <= hclog.Info }
func (l *hclogAdapter) IsWarn() bool                          { return l.level <= hclog.Warn }
func (l *hclogAdapter) IsError() bool                         { return l.level <= hclog.Error }
func (l *hclogAdapter) ImpliedArgs() []interface{}            { return l.implied }
func (l *hclogAdapter) Name() string                          { return l.name }
func (l *hclogAdapter) SetLevel(level hclog.Level)            { l.level = level }
func (l *hclogAdapter) GetLevel() hclog.Level                 { return l.level }

func (l *hclogAdapter) With(args ...interface{}) hclog.Logger {
	c := *l
	c.implied = append(append([]interface{}{}, l.implied...), args...)
	return &c
}

func (l *hclogAdapter) Named(name string) hclog.Logger {
	c := *l
	c.z = l.z.Named(name)
	c.name = l.name + "." + name
	return &c
}

func (l *hclogAdapter) ResetNamed(name string) hclog.Logger {
	c := *l
	c.name = name
	return &c
}

func (l *hclogAdapter) StandardLogger(opts *hclog.StandardLoggerOptions) *log.Logger {
	return log.New(l.StandardWriter(opts), "", 0)
}

func (l *hclogAdapter) StandardWriter(*hclog.StandardLoggerOptions) io.Writer {
	return zapWriter{l.z}
}

type zapWriter struct{ z *zap.Logger }

func (w zapWriter) Write(p []byte) (int, error) {
	w.z.Info(string(p))
	return len(p), nil
}
