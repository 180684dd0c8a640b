//go:build linux

package streamtest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labtest"
)

func TestMain(m *testing.M) {
	ChildMain(nil, 2*time.Minute)
	os.Exit(m.Run())
}

func TestStream(t *testing.T) {
	a, b := Stream(7, 1<<16), Stream(7, 1<<16)
	if !bytes.Equal(a, b) {
		t.Fatal("the same seed gave different streams")
	}
	if short := Stream(7, 1000); !bytes.Equal(short, a[:1000]) {
		t.Error("a shorter stream is not a prefix of a longer one")
	}
	if bytes.Equal(Stream(8, 1<<16), a) {
		t.Error("seeds 7 and 8 gave the same stream")
	}
	if zeros := bytes.Count(a, []byte{0}); zeros > 1<<16/128 {
		t.Errorf("%d zero bytes in 64 KiB: not pseudo-random", zeros)
	}
	if len(Stream(1, 0)) != 0 {
		t.Error("a stream of size 0 is not empty")
	}
}

func TestParseConnLine(t *testing.T) {
	for _, tc := range []struct {
		line    string
		want    netip.AddrPort
		wantSeq uint32
		wantErr bool
	}{
		{"conn 10.1.2.3:40001 12345", netip.MustParseAddrPort("10.1.2.3:40001"), 12345, false},
		{"conn 10.1.2.3:1 4294967295", netip.MustParseAddrPort("10.1.2.3:1"), 1<<32 - 1, false},
		{"conn 10.1.2.3:1 4294967296", netip.AddrPort{}, 0, true},
		{"conn 10.1.2.3 5", netip.AddrPort{}, 0, true},
		{"port 40001", netip.AddrPort{}, 0, true},
		{"", netip.AddrPort{}, 0, true},
	} {
		ap, seq, err := ParseConnLine(tc.line)
		if (err != nil) != tc.wantErr || ap != tc.want || seq != tc.wantSeq {
			t.Errorf("ParseConnLine(%q) = %v, %d, %v; want %v, %d, error %v", tc.line, ap, seq, err, tc.want, tc.wantSeq, tc.wantErr)
		}
	}
}

// TestRoles runs the shared roles between two lab hosts: the sender born in a
// cgroup from a fixed local port, the receiver pausing in the middle, and
// checks every line they print and the cgroup's membership.
func TestRoles(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	l := labtest.New(t, 2, 0)
	cg := NewCgroupT(t, "roles")
	h1, err := l.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	h2, err := l.Host("node2")
	if err != nil {
		t.Fatal(err)
	}
	dst := netip.AddrPortFrom(h2.Addr.Addr(), 7001)
	const size, pause, seed, lport = 16 << 20, 1<<20 + 3, 5, 40123

	recv := StartT(t, l, "node2", nil, "recv", "FTKIT_ADDR="+dst.String(), fmt.Sprintf("FTKIT_PAUSE_AT=%d", pause))
	if got := recv.LineT(ctx, t); got != "ready" {
		t.Fatalf("receiver said %q", got)
	}
	send := StartT(t, l, "node1", cg, "send", "FTKIT_ADDR="+dst.String(),
		fmt.Sprintf("FTKIT_SEED=%d", seed), fmt.Sprintf("FTKIT_SIZE=%d", size), fmt.Sprintf("FTKIT_LPORT=%d", lport))
	src, _, err := ParseConnLine(send.LineT(ctx, t))
	if err != nil {
		t.Fatal(err)
	}
	if want := netip.AddrPortFrom(h1.Addr.Addr(), lport); src != want {
		t.Errorf("sender's connection is from %v, want %v", src, want)
	}
	if got := recv.LineT(ctx, t); got != fmt.Sprintf("read %d", pause) {
		t.Fatalf("receiver said %q", got)
	}
	// The receiver waits and the stream is far larger than the socket
	// buffers: the sender is still running, in its cgroup.
	procs, err := os.ReadFile(filepath.Join(cg.Dir, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(strings.Fields(string(procs))); n != 1 {
		t.Errorf("cgroup %s holds %d processes (%q), want the sender", cg.Dir, n, procs)
	}
	if _, err := fmt.Fprintln(recv.Stdin); err != nil {
		t.Fatal(err)
	}
	if got, want := recv.LineT(ctx, t), fmt.Sprintf("%d %x", size, sha256.Sum256(Stream(seed, size))); got != want {
		t.Fatalf("receiver got %q, want %q", got, want)
	}
	if got := send.LineT(ctx, t); got != fmt.Sprintf("sent %d", size) {
		t.Fatalf("sender said %q", got)
	}
	if err := send.Wait(); err != nil {
		t.Fatalf("sender: %v", err)
	}
	if _, err := send.Line(ctx); err == nil {
		t.Error("Line after the sender exited: no error")
	}

	bad := StartT(t, l, "node1", nil, "nope")
	if err := bad.Wait(); err == nil || !strings.Contains(bad.Stderr.String(), "unknown child role") {
		t.Errorf("unknown role: exit %v, stderr %q", err, bad.Stderr.String())
	}
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelShort()
	idle := StartT(t, l, "node2", nil, "recv", "FTKIT_ADDR="+netip.AddrPortFrom(h2.Addr.Addr(), 7002).String())
	if got := idle.LineT(ctx, t); got != "ready" {
		t.Fatalf("receiver said %q", got)
	}
	if _, err := idle.Line(short); err == nil || !strings.Contains(err.Error(), "deadline exceeded") {
		t.Errorf("Line on a silent child with a 50 ms deadline: %v", err)
	}
}
