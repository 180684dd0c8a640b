package clusterapi

import (
	"context"
	"net"
	"strings"
	"testing"
)

// TestHostAnswers: the kernel's answer, a completed handshake or a refusal, says the host runs, whatever
// its agent does (a listener nobody accepts on stands for an agent too busy to answer).
func TestHostAnswers(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close() // never accepts: the kernel completes the handshake alone
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()
	c := NewClient(ClientConfig{Resolve: func(name string) (string, bool) {
		a, ok := map[string]string{"busy": busy.Addr().String(), "down": closedAddr}[name]
		return a, ok
	}})
	defer c.Close()
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	for _, tc := range []struct {
		name, peer string
		ctx        context.Context
		want       string // "" for nil
	}{
		{"handshake completed", "busy", t.Context(), ""},
		{"connection refused", "down", t.Context(), ""},
		{"no answer in time", "busy", cancelled, "TCP handshake with busy"},
		{"not a member", "stranger", t.Context(), "not a cluster member"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := c.HostAnswers(tc.ctx, tc.peer)
			if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("HostAnswers = %v, want %q", err, tc.want)
			}
		})
	}
}
