package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Path is where the endpoint serves the metrics.
const Path = "/metrics"

// CheckListen validates a listen address: ip:port with a fixed port ("" is valid: no endpoint).
func CheckListen(addr string) error {
	if addr == "" {
		return nil
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return fmt.Errorf("%q: use ip:port, like 127.0.0.1:9464 or [::1]:9464 (empty: no metrics endpoint)", addr)
	}
	if ap.Port() == 0 {
		return fmt.Errorf("%q: use a fixed port, like 127.0.0.1:9464, that Prometheus can be told", addr)
	}
	return nil
}

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(Path, promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		Registry: m.reg, // promhttp's own error and in-flight counters
		// A scrape reads the agent's state under its locks: one slow scraper must not pile up readers.
		MaxRequestsInFlight: 4,
		Timeout:             20 * time.Second,
		ErrorHandling:       promhttp.ContinueOnError,
	}))
	return mux
}

// Server is a running endpoint.
type Server struct {
	Addr string // where it listens (the port chosen, if the address asked for port 0)
	srv  *http.Server
}

// Close stops the endpoint at once.
func (s *Server) Close() error { return s.srv.Close() }

// Serve listens on addr (ip:port) and serves Handler until ctx ends; it returns once listening. The listen
// error is returned at once, so that an agent configured with a taken port refuses to start.
func (m *Metrics) Serve(ctx context.Context, addr string, log *slog.Logger) (*Server, error) {
	if _, err := netip.ParseAddrPort(addr); err != nil {
		return nil, fmt.Errorf("metrics endpoint %q: use ip:port: %w", addr, err)
	}
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics endpoint: %w (change metrics.listen, or leave it empty)", err)
	}
	// The endpoint answers anybody who reaches addr: bounded reads and writes, small headers.
	srv := &http.Server{
		Handler:           m.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       time.Minute,
		MaxHeaderBytes:    16 << 10,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics endpoint stopped", "addr", addr, "err", err)
		}
	}()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	s := &Server{Addr: ln.Addr().String(), srv: srv}
	log.Info("metrics endpoint listening", "addr", s.Addr, "path", Path)
	return s, nil
}
