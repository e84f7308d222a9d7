package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/redistest"
)

// captureStderr sends os.Stderr (where run's logger writes, as os.Stderr is
// when run builds it) to a buffer until the test ends, and returns what it
// holds so far.
func captureStderr(t *testing.T) func() string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		out bytes.Buffer
	)
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		b := make([]byte, 4096)
		for {
			n, err := r.Read(b)
			mu.Lock()
			out.Write(b[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	stderr := os.Stderr
	os.Stderr = w
	t.Cleanup(func() {
		os.Stderr = stderr
		w.Close()
		<-copied
		r.Close()
	})
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		return out.String()
	}
}

// TestKeySaltFromTheEnvironment: regionagent takes the key salt from
// $ALLOT_KEY_SALT (which ps does not show) as it would from -key-salt: the
// Redis key names are the same, and not the unsalted ones; the flag still
// works, with a warning that it shows the secret. An agent on Redis without
// a key salt warns at start that principals can be recovered from its key
// names; one with a salt does not. $ALLOT_LOG_SALT keys the decision logs'
// hashes. The salts used to come from the flags only.
func TestKeySaltFromTheEnvironment(t *testing.T) {
	// The names are spelled out: they are what operators set.
	const keySaltEnv, logSaltEnv = "ALLOT_KEY_SALT", "ALLOT_LOG_SALT"
	srv := redistest.NewServer(t)
	rdb := srv.Client()
	defer rdb.Close()
	const (
		salt = "pepper-0123456789"
		user = "b1"
	)
	n := 0
	// agent runs an agent on srv with env and args, decides one request
	// and stops; it returns the key names the request made (without the
	// namespace) and what the agent logged.
	agent := func(t *testing.T, env map[string]string, args ...string) ([]string, string) {
		t.Helper()
		for _, k := range []string{keySaltEnv, logSaltEnv} {
			t.Setenv(k, env[k])
		}
		n++
		ns := fmt.Sprintf("salt%d", n)
		logged := captureStderr(t)
		api := freeAddr(t)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			errc <- run(ctx, append([]string{"-region", "eu", "-store", "redis", "-redis", srv.Addr(), "-namespace", ns,
				"-policy", writePolicy(t), "-api-addr", api, "-envoy-addr", "", "-shutdown-timeout", "300ms",
				"-log-sample", "1", "-log-level", "info"}, args...))
		}()
		stopped := false
		stop := func() {
			if !stopped {
				stopped = true
				cancel()
				if err := <-errc; err != nil {
					t.Errorf("run: %v", err)
				}
			}
		}
		defer stop()
		if err := waitReady(api); err != nil {
			t.Fatalf("%v; logged %s", err, logged())
		}
		body := `{"entries":[{"key":"tenant","value":"acme"},{"key":"user","value":"` + user + `"}]}`
		resp, err := http.Post("http://"+api+"/allot.v1.AdmissionService/Check", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("Check: %s", resp.Status)
		}
		stop()
		keys, err := rdb.Keys(context.Background(), ns+":*").Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) == 0 {
			t.Fatalf("no keys under %s: after a Check", ns)
		}
		for i, k := range keys {
			keys[i] = strings.TrimPrefix(k, ns+":")
		}
		slices.Sort(keys)
		return keys, logged()
	}
	const unsalted = "without a secret salt"

	fromEnv, envLog := agent(t, map[string]string{keySaltEnv: salt, logSaltEnv: salt})
	fromFlag, flagLog := agent(t, nil, "-key-salt", salt)
	none, noneLog := agent(t, nil)
	if !slices.Equal(fromEnv, fromFlag) {
		t.Errorf("keys with $%s: %v; with -key-salt: %v; want the same", keySaltEnv, fromEnv, fromFlag)
	}
	if slices.Equal(fromEnv, none) {
		t.Errorf("keys with $%s: %v, the same as without a salt: the variable was not read", keySaltEnv, fromEnv)
	}

	if !strings.Contains(noneLog, unsalted) {
		t.Errorf("no warning at start on Redis without a key salt; logged %s", noneLog)
	}
	if strings.Contains(envLog, unsalted) || strings.Contains(flagLog, unsalted) {
		t.Errorf("warned of an unsalted key hash with a key salt set; logged %s and %s", envLog, flagLog)
	}
	if !strings.Contains(flagLog, "-key-salt shows") {
		t.Errorf("no warning that -key-salt shows its secret; logged %s", flagLog)
	}
	if strings.Contains(envLog, "-key-salt shows") || strings.Contains(envLog, "-log-salt shows") {
		t.Errorf("warned of a flag with the salts in the environment; logged %s", envLog)
	}

	m := hmac.New(sha256.New, []byte(salt))
	m.Write([]byte("user\x00" + user))
	if h := "#" + hex.EncodeToString(m.Sum(nil)[:8]); !strings.Contains(envLog, h) {
		t.Errorf("decision log without the user hashed with $%s (%s); logged %s", logSaltEnv, h, envLog)
	}
}

// TestSaltFlagAndEnvironmentMustAgree: a salt given both in its variable
// and (deprecated) by its flag must be the same in both, or the agent does
// not start: a region whose agents disagree on the key salt would split its
// counters without a word.
func TestSaltFlagAndEnvironmentMustAgree(t *testing.T) {
	for _, tt := range []struct{ flag, env string }{{"-key-salt", "ALLOT_KEY_SALT"}, {"-log-salt", "ALLOT_LOG_SALT"}} {
		t.Run(tt.flag, func(t *testing.T) {
			t.Setenv(tt.env, "from-the-environment")
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			err := run(ctx, []string{"-region", "eu", "-store", "embedded", "-policy", writePolicy(t), "-api-addr", freeAddr(t),
				"-envoy-addr", "", "-log-level", "error", tt.flag, "from-the-flag"})
			if err == nil || !strings.Contains(err.Error(), tt.flag) || !strings.Contains(err.Error(), "$"+tt.env) {
				t.Fatalf("run with %s and $%s different: %v, want an error naming both", tt.flag, tt.env, err)
			}
			if strings.Contains(err.Error(), "from-the") {
				t.Fatalf("error %q shows a secret", err)
			}
		})
	}
}

// TestSecretSetting: the variable alone, the flag alone (with a warning
// naming the variable), both the same (with the warning), both different
// (refused).
func TestSecretSetting(t *testing.T) {
	for _, tt := range []struct {
		flag, env, want string
		note, fails     bool
	}{
		{"", "", "", false, false},
		{"", "e", "e", false, false},
		{"f", "", "f", true, false},
		{"s", "s", "s", true, false},
		{"f", "e", "", false, true},
	} {
		v, note, err := secretSetting(tt.flag, "key-salt", keySaltEnv, func(k string) string {
			if k != keySaltEnv {
				t.Fatalf("read $%s, want $%s", k, keySaltEnv)
			}
			return tt.env
		})
		if v != tt.want || (note != "") != tt.note || (err != nil) != tt.fails || (tt.note && !strings.Contains(note, "$"+keySaltEnv)) {
			t.Errorf("flag %q, $%s %q: %q, note %q, err %v", tt.flag, keySaltEnv, tt.env, v, note, err)
		}
	}
}
