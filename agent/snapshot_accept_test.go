package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
)

// TestWhenAccepted: a dump CRIU refused for a connection waiting in a listen queue is taken again once the
// job has accepted it, within a bound; any other failure is returned at once. (In the CI run of 577c21d a
// snapshot asked for moments after a ring's rank was connected to failed this way, and its test with it.)
func TestWhenAccepted(t *testing.T) {
	listener := netip.MustParseAddrPort("10.1.0.1:7480")
	inFlight := fmt.Errorf("criu dump of pid 7: %w: exit status 1", criu.ErrInFlight)
	other := errors.New("criu dump of pid 7: exit status 1")
	for _, tc := range []struct {
		name     string
		dumps    []error            // each dump's result, in turn; the last repeats
		waiting  [][]netip.AddrPort // each look at the listen queues, in turn; the last repeats
		waitErr  error              // the look fails
		cancel   bool               // the context is cancelled
		wantErr  error              // nil: a manifest
		wantText string             // in the error
		dumped   int                // dumps run (0: do not check)
		lookedAt func(n int) bool   // looks at the queues (nil: do not check)
	}{
		{name: "first dump", dumps: []error{nil}, dumped: 1, lookedAt: func(n int) bool { return n == 0 }},
		{name: "another failure", dumps: []error{other}, wantErr: other, dumped: 1, lookedAt: func(n int) bool { return n == 0 }},
		{name: "accepted after three looks", dumps: []error{inFlight, nil},
			waiting: [][]netip.AddrPort{{listener}, {listener}, nil}, dumped: 2, lookedAt: func(n int) bool { return n == 3 }},
		{name: "accepted while CRIU failed", dumps: []error{inFlight, nil}, waiting: [][]netip.AddrPort{nil}, dumped: 2},
		{name: "never accepted", dumps: []error{inFlight}, waiting: [][]netip.AddrPort{{listener}},
			wantErr: criu.ErrInFlight, wantText: "did not accept them within", dumped: 1},
		{name: "new connections keep arriving", dumps: []error{inFlight}, waiting: [][]netip.AddrPort{nil},
			wantErr: criu.ErrInFlight, wantText: "kept arriving"},
		{name: "queues unreadable", dumps: []error{inFlight}, waitErr: errors.New("sock_diag: EPERM"),
			wantErr: criu.ErrInFlight, wantText: "sock_diag: EPERM", dumped: 1},
		{name: "cancelled", dumps: []error{inFlight}, waiting: [][]netip.AddrPort{{listener}}, cancel: true,
			wantErr: context.Canceled, dumped: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			dumped, looked := 0, 0
			dump := func() (*ckpt.Manifest, error) {
				err := tc.dumps[min(dumped, len(tc.dumps)-1)]
				dumped++
				if err != nil {
					return nil, err
				}
				return &ckpt.Manifest{ID: "s"}, nil
			}
			waiting := func() ([]netip.AddrPort, error) {
				looked++
				if tc.cancel {
					cancel()
				}
				if tc.waitErr != nil {
					return nil, tc.waitErr
				}
				return tc.waiting[min(looked-1, len(tc.waiting)-1)], nil
			}
			const wait = 150 * time.Millisecond
			start := time.Now()
			m, err := whenAccepted(ctx, wait, dump, waiting)
			took := time.Since(start)
			switch {
			case tc.wantErr == nil && (err != nil || m == nil):
				t.Fatalf("got %v, %v; want a manifest", m, err)
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Fatalf("error %v, want one that is %v", err, tc.wantErr)
			case tc.wantErr != nil && !strings.Contains(err.Error(), tc.wantText):
				t.Errorf("error %q lacks %q", err, tc.wantText)
			}
			if tc.dumped != 0 && dumped != tc.dumped {
				t.Errorf("%d dumps, want %d", dumped, tc.dumped)
			}
			if tc.lookedAt != nil && !tc.lookedAt(looked) {
				t.Errorf("looked at the listen queues %d times", looked)
			}
			if tc.wantText == "kept arriving" && dumped > int(wait/acceptPoll)+1 {
				t.Errorf("%d dumps in %s: the job's listen queues were not looked at between them", dumped, wait)
			}
			if tc.wantText == "did not accept them within" && took < wait {
				t.Errorf("gave up after %s, before its bound %s", took, wait)
			}
		})
	}
}

// TestFreezeAccepted: frozen jobs (a coordinated or semi-coordinated snapshot's) with a connection waiting
// in a listen queue are thawed until they have accepted it and frozen again, before any dump; within a
// bound, after which the error names the listeners. (Before, only an uncoordinated snapshot waited: a
// coordinated one failed its dump with criu.ErrInFlight.)
func TestFreezeAccepted(t *testing.T) {
	listener := netip.MustParseAddrPort("10.1.0.1:7480")
	ended := errors.New("the hold ended")
	for _, tc := range []struct {
		name     string
		waiting  [][]netip.AddrPort // each look at the listen queues, in turn; the last repeats
		waitErr  error              // the looks fail
		freezes  []error            // each freeze's result, in turn; the last repeats
		wantErr  error
		wantText string
		froze    int // freezes run
		thawed   int
	}{
		{name: "nothing waits", waiting: [][]netip.AddrPort{nil}, freezes: []error{nil}, froze: 1},
		{name: "accepted while thawed", waiting: [][]netip.AddrPort{{listener}, {listener}, nil}, freezes: []error{nil}, froze: 2, thawed: 1},
		{name: "another one after the freeze", waiting: [][]netip.AddrPort{{listener}, nil, {listener}, nil}, freezes: []error{nil}, froze: 3, thawed: 2},
		{name: "never accepted", waiting: [][]netip.AddrPort{{listener}}, freezes: []error{nil},
			wantErr: criu.ErrInFlight, wantText: "10.1.0.1:7480", froze: 2, thawed: 1}, // looked at once more, frozen
		{name: "queues unreadable: left to the dump", waitErr: errors.New("sock_diag: EPERM"), freezes: []error{nil}, froze: 1},
		{name: "the hold ended while thawed", waiting: [][]netip.AddrPort{{listener}, nil}, freezes: []error{nil, ended},
			wantErr: ended, froze: 2, thawed: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			froze, thawed, looked := 0, 0, 0
			freeze := func() error {
				froze++
				return tc.freezes[min(froze, len(tc.freezes))-1]
			}
			waiting := func() ([]netip.AddrPort, error) {
				looked++
				if tc.waitErr != nil {
					return nil, tc.waitErr
				}
				return tc.waiting[min(looked, len(tc.waiting))-1], nil
			}
			const wait = 150 * time.Millisecond
			err := freezeAccepted(t.Context(), wait, freeze, func() { thawed++ }, waiting)
			switch {
			case tc.wantErr == nil && err != nil:
				t.Fatalf("error %v, want none", err)
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Fatalf("error %v, want one that is %v", err, tc.wantErr)
			case tc.wantErr != nil && !strings.Contains(err.Error(), tc.wantText):
				t.Errorf("error %q lacks %q", err, tc.wantText)
			}
			if froze != tc.froze || thawed != tc.thawed {
				t.Errorf("froze %d times, thawed %d; want %d, %d", froze, thawed, tc.froze, tc.thawed)
			}
		})
	}
}
