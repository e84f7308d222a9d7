package allocator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// NewHTTPClient returns an HTTP client that speaks HTTP/2 only: cleartext
// with prior knowledge for http:// URLs (as allot's servers accept), and over
// TLS for https://. With HTTP/1.1 also enabled, net/http would use HTTP/1.1
// for every http:// URL: one connection per concurrent call instead of
// multiplexed streams on one.
//
// A connection silent for a second is pinged and closed when the ping is
// not answered within a second: a connection a partition left half-dead
// (its packets dropped, TCP's retransmissions backing off) would otherwise
// keep taking the calls multiplexed on it after the network heals, each
// until its attempt timeout.
func NewHTTPClient() *http.Client {
	var p http.Protocols
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		Protocols:           &p,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 15 * time.Second}).DialContext,
		HTTP2:               &http.HTTP2Config{SendPingTimeout: time.Second, PingTimeout: time.Second},
	}}
}

// baseURL turns "host:port" into "http://host:port"; full URLs pass through.
func baseURL(addr string) string {
	if strings.HasPrefix(addr, "http://") || strings.HasPrefix(addr, "https://") {
		return addr
	}
	return "http://" + addr
}

// Mux serves the Connect API, /metrics, /healthz (the process is up) and
// /readyz (this node knows a leader).
func Mux(s *Server, gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/", s.Handler())
	if gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		id, _ := s.node.Leader()
		if id == "" {
			http.Error(w, "no leader known", http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintf(w, "leader %s\n", id)
	})
	return mux
}

// HTTPServer returns a server for h with HTTP/1.1 and cleartext HTTP/2 and
// conservative timeouts (streams such as WatchPolicy are long-lived, so there
// is no write timeout for a whole response: WatchPolicy bounds each of its
// sends instead, Config.WatchSendTimeout).
func HTTPServer(addr string, h http.Handler) *http.Server {
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		Protocols:         &p,
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
}

// Serve runs srv on ln until ctx ends, then shuts it down gracefully within
// grace, and closes the connections still open after it.
func Serve(ctx context.Context, srv *http.Server, ln net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := srv.Shutdown(sctx)
	if err != nil {
		// Shutdown leaves the connections it could not drain open, and their
		// handlers running against whatever the caller closes next.
		_ = srv.Close()
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}
