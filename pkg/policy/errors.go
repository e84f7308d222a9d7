package policy

import (
	"errors"
	"fmt"
	"strings"
)

// ErrInvalid is wrapped by every error Parse, Validate and Canonical return
// for a malformed or unsafe policy. Match it with errors.Is.
var ErrInvalid = errors.New("invalid policy")

// maxReportedErrors caps how many problems one Validate call lists.
const maxReportedErrors = 50

// FieldError is one problem at a field path such as "rules[2].cost". Find
// the first one with errors.As.
type FieldError struct {
	// Path is the field, e.g. "rules[2].lease.ttl"; "" for the whole document.
	Path string
	// Line is the 1-based source line, or 0 when unknown.
	Line int
	// Msg says what is wrong, e.g. "30 exceeds capacity 20".
	Msg string
}

// Error formats the problem as "path: msg (line n)".
func (e *FieldError) Error() string {
	var b strings.Builder
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	if e.Line > 0 {
		fmt.Fprintf(&b, " (line %d)", e.Line)
	}
	return b.String()
}

// Unwrap returns ErrInvalid.
func (e *FieldError) Unwrap() error { return ErrInvalid }

// Errors is every problem found in one document, in document order.
type Errors []*FieldError

// Error formats the list as "invalid policy: a; b; ...".
func (es Errors) Error() string {
	msgs := make([]string, len(es))
	for i, e := range es {
		msgs[i] = e.Error()
	}
	return ErrInvalid.Error() + ": " + strings.Join(msgs, "; ")
}

// Unwrap returns the individual problems, so errors.Is(err, ErrInvalid) and
// errors.As(err, &fieldErr) work.
func (es Errors) Unwrap() []error {
	errs := make([]error, len(es))
	for i, e := range es {
		errs[i] = e
	}
	return errs
}

// collector accumulates FieldErrors up to maxReportedErrors.
type collector struct {
	errs      Errors
	truncated bool
}

func (c *collector) add(path string, line int, format string, args ...any) {
	if len(c.errs) >= maxReportedErrors {
		c.truncated = true
		return
	}
	c.errs = append(c.errs, &FieldError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)})
}

func (c *collector) full() bool { return len(c.errs) >= maxReportedErrors }

func (c *collector) err() error {
	if len(c.errs) == 0 {
		return nil
	}
	if c.truncated {
		c.errs = append(c.errs, &FieldError{Msg: "further problems not listed"})
	}
	return c.errs
}
