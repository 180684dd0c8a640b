package agent

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/heldconns"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestInFlight(t *testing.T) {
	end := func(netns, local, remote string, sent, received uint64, unacked uint32) flowIn {
		return flowIn{netns, heldconns.Flow{
			Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote)},
			Sent: sent, Received: received, Unacked: unacked,
		}}
	}
	fin := func(e flowIn, sent, received bool) flowIn {
		e.FinSent, e.FinReceived = sent, received
		return e
	}
	const a, b = "127.0.0.1:7301", "127.0.0.1:40000"
	tests := []struct {
		name string
		ends []flowIn
		want []string
	}{
		{"all arrived and acknowledged", []flowIn{end("", a, b, 100, 50, 0), end("", b, a, 50, 100, 0)}, nil},
		{"arrived, acknowledgment delayed", []flowIn{end("", a, b, 100, 50, 1), end("", b, a, 50, 100, 0)}, nil},
		{"in flight one way", []flowIn{end("", a, b, 4196, 50, 1), end("", b, a, 50, 100, 0)},
			[]string{a + " -> " + b + ": 1 segment(s) unacknowledged"}},
		{"in flight both ways", []flowIn{end("", a, b, 4196, 50, 1), end("", b, a, 4146, 100, 2)},
			[]string{b + " -> " + a + ": 2 segment(s) unacknowledged", a + " -> " + b + ": 1 segment(s) unacknowledged"}},
		// A restored end counts from its restore: the counts do not compare, the acknowledgments decide.
		{"restored sender, acknowledged", []flowIn{end("", a, b, 10, 0, 0), end("", b, a, 0, 9000, 0)}, nil},
		{"restored sender, unacknowledged", []flowIn{end("", a, b, 10, 0, 1), end("", b, a, 0, 9000, 0)},
			[]string{a + " -> " + b + ": 1 segment(s) unacknowledged"}},
		{"other end in no frozen job", []flowIn{end("", a, b, 4196, 50, 1)}, nil},
		// A FIN moves no byte count: all the bytes arrived, the FIN not yet. Dumped after its acknowledgment,
		// the sender's snapshot holds it sent, the receiver's lacks it, and Match refuses the two.
		{"FIN in flight", []flowIn{fin(end("", a, b, 100, 50, 1), true, false), end("", b, a, 50, 100, 0)},
			[]string{a + " -> " + b + ": 1 segment(s) unacknowledged"}},
		{"FIN arrived, acknowledgment on its way", []flowIn{fin(end("", a, b, 100, 50, 1), true, false), fin(end("", b, a, 50, 100, 0), false, true)}, nil},
		// A loopback connection is private to its network namespace: the same tuple in another is another
		// connection.
		{"loopback ends in two namespaces", []flowIn{end("job1", a, b, 4196, 50, 1), end("job2", b, a, 50, 100, 0)}, nil},
		{"job addresses across namespaces", []flowIn{
			end("job1", "10.1.0.5:7301", "10.1.0.6:40000", 4196, 0, 1),
			end("job2", "10.1.0.6:40000", "10.1.0.5:7301", 0, 100, 0),
		}, []string{"10.1.0.5:7301 -> 10.1.0.6:40000: 1 segment(s) unacknowledged"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := inFlight(tt.ends); !slices.Equal(got, tt.want) {
				t.Errorf("inFlight = %q, want %q", got, tt.want)
			}
		})
	}
}

// settle lists until nothing is in flight, and gives up past its bound, on a listing error or when its
// context ends.
func TestSettle(t *testing.T) {
	stuck := []flowIn{
		{"", heldconns.Flow{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("127.0.0.1:1"), Remote: netip.MustParseAddrPort("127.0.0.1:2")}, Sent: 10, Unacked: 1}},
		{"", heldconns.Flow{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("127.0.0.1:2"), Remote: netip.MustParseAddrPort("127.0.0.1:1")}}},
	}
	arrived := slices.Clone(stuck)
	arrived[1].Received = 10
	listing := errors.New("sock_diag failed")
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		lists   [][]flowIn // one per call; the last repeats
		err     error
		wantErr string
		calls   int
	}{
		{"nothing in flight", t.Context(), [][]flowIn{arrived}, nil, "", 1},
		{"arrives at the third look", t.Context(), [][]flowIn{stuck, stuck, arrived}, nil, "", 3},
		{"never arrives", t.Context(), [][]flowIn{stuck}, nil, "127.0.0.1:1 -> 127.0.0.1:2: 1 segment(s) unacknowledged", 0},
		{"listing fails", t.Context(), [][]flowIn{stuck}, listing, "sock_diag failed", 1},
		{"context ends", canceled, [][]flowIn{stuck}, nil, "context canceled", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			calls := 0
			list := func() ([]flowIn, error) {
				calls++
				return tt.lists[min(calls, len(tt.lists))-1], tt.err
			}
			_, err := settle(tt.ctx, list, 50*time.Millisecond)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("settle: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("settle: %v, want an error with %q", err, tt.wantErr)
			case tt.calls > 0 && calls != tt.calls:
				t.Errorf("listed %d times, want %d", calls, tt.calls)
			}
		})
	}
}
