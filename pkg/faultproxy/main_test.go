package faultproxy

import (
	"testing"

	"go.uber.org/goleak"
)

// Run must leave no goroutine behind once it returns.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
