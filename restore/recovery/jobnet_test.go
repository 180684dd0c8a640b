package recovery

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

var jobAddr = netip.MustParseAddr("10.0.0.201")

// fakeJobNet is a job's own network, recording into the fake's net list with a "job: " prefix; its address
// is addr, or jobAddr.
type fakeJobNet struct {
	f    *fake
	addr netip.Addr
}

func (n fakeJobNet) rec(s string) { addTo(n.f, &n.f.net, "job: "+s) }

func (n fakeJobNet) Create(context.Context) error {
	if n.f.createErr != nil {
		return n.f.createErr
	}
	n.rec("create")
	return nil
}
func (n fakeJobNet) Delete(context.Context) error {
	n.rec("delete")
	return n.f.deleteErr
}
func (n fakeJobNet) Addr() netip.Addr {
	if n.addr.IsValid() {
		return n.addr
	}
	return jobAddr
}
func (n fakeJobNet) Guard(_ context.Context, runID string, _ []ckpt.Conn, addrs []netip.Addr) error {
	n.rec(guardEntry(runID, addrs))
	return nil
}
func (n fakeJobNet) Unguard(_ context.Context, runID string) error {
	n.rec("unguard " + runID)
	return nil
}
func (n fakeJobNet) TakeOver(ip netip.Addr) error {
	n.rec("take over " + ip.String())
	return errors.New("a job network holds only its job's address")
}
func (n fakeJobNet) Release(ip netip.Addr) { n.rec("release " + ip.String()) }
func (n fakeJobNet) SetInitCwnd(segments int) (func() error, error) {
	n.rec(fmt.Sprintf("initcwnd %d", segments))
	return func() error { n.rec("put back initcwnd"); return nil }, nil
}
func (n fakeJobNet) LowerPathMTU() (func() error, error) {
	n.rec("lower mtu")
	return func() error { n.rec("put back mtu"); return nil }, nil
}
func (n fakeJobNet) ResetPeer(conn tcpflow.Tuple, seq uint32) error {
	n.rec(fmt.Sprintf("reset %s at %d", conn, seq))
	return nil
}
func (n fakeJobNet) DeliverFromPeer(_ context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, _ uint32) error {
	n.rec(fmt.Sprintf("inject %s at %d: %d bytes", conn, h.Seq, len(payload)))
	return nil
}
func (n fakeJobNet) DeliverFIN(_ context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error {
	n.rec(fmt.Sprintf("fin %s at %d", conn, h.Seq))
	return nil
}

func (n fakeJobNet) Announce(_ context.Context, ip netip.Addr) error {
	n.rec("announce " + ip.String())
	return nil
}

// TestRunJobNetwork: a job with an address of its own is restored into its own network, created on this
// host before its guard, which goes up inside it; the initial window and the path MTU are set there too;
// its address is announced from it; with no host address in the request, none is taken over. A failed
// restore, or a failure while preparing, removes the job's network (its address must not answer without
// the job).
func TestRunJobNetwork(t *testing.T) {
	tests := []struct {
		name    string
		setup   func(f *fake)
		wantErr string
		wantNet []string
		// givenBack: the job's incarnation is returned (it never ran).
		givenBack bool
	}{
		{
			name: "restored inside its network, its address announced, no host address taken over",
			wantNet: []string{"job: create", "job: guard run-rank1 holding [10.0.0.201]", "initcwnd 10", "job: initcwnd 10", "lower mtu", "job: lower mtu",
				"put back mtu", "job: put back mtu", "job: announce 10.0.0.201", "put back initcwnd", "job: put back initcwnd"},
		},
		{
			name:    "CRIU restore fails: unguarded and deleted",
			setup:   func(f *fake) { f.restoreErr = errors.New("criu restore: exit 1") },
			wantErr: "criu restore: exit 1",
			wantNet: []string{"job: create", "job: guard run-rank1 holding [10.0.0.201]", "initcwnd 10", "job: initcwnd 10", "lower mtu", "job: lower mtu",
				"job: unguard run-rank1", "job: delete", "put back mtu", "job: put back mtu", "put back initcwnd", "job: put back initcwnd"},
		},
		{
			// Create may have failed half-way (its namespace made, its interface up with the job's address,
			// its default route refused): deleted, lest the address answer here with no job behind it.
			name:      "the job's network cannot be created: nothing guarded, what Create left deleted, incarnation given back",
			setup:     func(f *fake) { f.createErr = errors.New("operation not supported") },
			wantErr:   "create the network of job rank1: operation not supported",
			wantNet:   []string{"job: delete"},
			givenBack: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			f.jobNet = true
			if tt.setup != nil {
				tt.setup(f)
			}
			req := request(snap1)
			req.Addrs = nil // every job of the failed node has its own address
			err := Run(t.Context(), req, f.deps(), func(Stage) {})
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("Run = %v; want error containing %q", err, tt.wantErr)
			}
			if !reflect.DeepEqual(f.net, tt.wantNet) {
				t.Errorf("network %q\nwant    %q", f.net, tt.wantNet)
			}
			if tt.givenBack && !reflect.DeepEqual(f.givenBack, []string{"rank1"}) {
				t.Errorf("given back %v, want rank1", f.givenBack)
			}
		})
	}
}

// TestRunJobNetworkLeft: a job network a failed recovery cannot delete may stay on the wire with the job's
// address. Only logged, it was neither recorded as left nor held its address: nothing deleted it again, and
// the address went to the next job while the left namespace still answered for it. Run hands it to the
// agent (Jobs.NetLeft), which records it and keeps its address until a deletion succeeds.
func TestRunJobNetworkLeft(t *testing.T) {
	cannotDelete := errors.New("delete eth0: device or resource busy")
	tests := []struct {
		name     string
		setup    func(f *fake)
		wantLeft []string
	}{
		{
			name:     "preparing fails and the half-made network cannot be deleted",
			setup:    func(f *fake) { f.createErr = errors.New("operation not supported"); f.deleteErr = cannotDelete },
			wantLeft: []string{"rank1"},
		},
		{
			name:     "CRIU restore fails and the network cannot be deleted",
			setup:    func(f *fake) { f.restoreErr = errors.New("criu restore: exit 1"); f.deleteErr = cannotDelete },
			wantLeft: []string{"rank1"},
		},
		{
			name:  "CRIU restore fails and the network is deleted: nothing left",
			setup: func(f *fake) { f.restoreErr = errors.New("criu restore: exit 1") },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			f.jobNet = true
			tt.setup(f)
			req := request(snap1)
			req.Addrs = nil
			if err := Run(t.Context(), req, f.deps(), func(Stage) {}); err == nil {
				t.Fatal("Run succeeded")
			}
			if !reflect.DeepEqual(f.netLeft, tt.wantLeft) {
				t.Errorf("networks reported left %q, want %q", f.netLeft, tt.wantLeft)
			}
		})
	}
}
