package recovery

import (
	"context"
	"errors"
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// rangePeer is Peers with one member, node1, answering LogRange with reply.
type rangePeer struct {
	reply func(req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte)
}

func (p rangePeer) Owner(context.Context, netip.Addr) string { return "node1" }

func (p rangePeer) LogRange(_ context.Context, _ string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
	rep, data := p.reply(req)
	return rep, data, nil
}

func (p rangePeer) Received(context.Context, string, tcpflow.Tuple, uint32) (*recvdigest.Received, error) {
	return nil, errors.New("not asked")
}

// misplacedRanges are replies to a request from sequence 1000 that are not that range: the peer (another
// host) answers from another sequence number, or with fewer bytes than it announces.
var misplacedRanges = map[string]struct {
	from uint32
	len  int64
	n    int
}{
	"starts later than asked":         {from: 1005, len: 20, n: 20},
	"starts earlier than asked":       {from: 990, len: 30, n: 30},
	"starts across the wrap":          {from: 1000 + 1<<31, len: 20, n: 20},
	"fewer bytes than it announces":   {from: 1000, len: 20, n: 10},
	"more bytes than it announces":    {from: 1000, len: 10, n: 20},
	"announces bytes and sends none":  {from: 1000, len: 20, n: 0},
	"announces none and sends some":   {from: 1000, len: 0, n: 20},
	"an empty range at another place": {from: 7, len: 0, n: 0},
}

// TestFetchConnRefusesMisplacedRange: the bytes a peer's agent returns go into the restored receive queue
// from the snapshot's receive point on, so a reply that is not the range asked for (another start, or not
// the bytes it announces) is refused: placed as asked, its bytes would be delivered to the restored
// program at the wrong sequence numbers, a silently different stream. The exact range is taken.
func TestFetchConnRefusesMisplacedRange(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	c := ckpt.Conn{Tuple: conn, InqSeq: 1000, OutqSeq: 5000}
	live := ebpfprobes.FlowState{HasAck: true, Ack: 5000, SndNxt: 1020}
	for name, r := range misplacedRanges {
		t.Run(name, func(t *testing.T) {
			peers := rangePeer{func(req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte) {
				l := live
				return clusterapi.LogRangeReply{From: r.from, Len: r.len, Live: &l}, make([]byte, r.n)
			}}
			got := fetchConn(t.Context(), Deps{Peers: peers}, c)
			if got.err == nil {
				t.Fatalf("fetchConn took %d bytes announced from %d (%d announced) as the bytes from %d", len(got.peer.Logged), r.from, r.len, c.InqSeq)
			}
			if !strings.Contains(got.err.Error(), "node1") {
				t.Errorf("error %q does not name the peer's member", got.err)
			}
		})
	}
	t.Run("the range asked for", func(t *testing.T) {
		peers := rangePeer{func(req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte) {
			l := live
			return clusterapi.LogRangeReply{From: req.From, Len: 20, Live: &l}, make([]byte, 20)
		}}
		if got := fetchConn(t.Context(), Deps{Peers: peers}, c); got.err != nil || len(got.peer.Logged) != 20 {
			t.Fatalf("fetchConn = %d bytes, %v; want the 20 bytes", len(got.peer.Logged), got.err)
		}
	})
}

// TestDeliverLoggedRefusesMisplacedRange: what a peer sent during a receive-order replay (deliverHeld), or
// the rest a resumed recovery delivers (DeliverRest), is injected from the sequence number asked for: a
// reply from another one is refused before anything is injected.
func TestDeliverLoggedRefusesMisplacedRange(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.12:7302"), Remote: netip.MustParseAddrPort("10.0.0.11:40000")}
	for name, r := range misplacedRanges {
		t.Run(name, func(t *testing.T) {
			f := newFake(t)
			f.owners[conn.Remote.Addr()] = "node1"
			f.logRange = func(_ string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
				live := ebpfprobes.FlowState{SndNxt: req.From + 20, Ack: 5000, HasAck: true}
				return clusterapi.LogRangeReply{From: r.from, Len: r.len, Live: &live}, make([]byte, r.n), nil
			}
			dc := DeferredConn{Tuple: conn, InqSeq: 1000, OutqSeq: 5000}
			n, err := deliverLogged(t.Context(), f.deps(), fakeNet{f}, dc, 1000, nil)
			if err == nil {
				t.Fatalf("deliverLogged delivered %d bytes of a reply from %d as the bytes from 1000", n, r.from)
			}
			if i := slices.IndexFunc(f.net, func(e string) bool { return strings.HasPrefix(e, "inject ") }); i >= 0 {
				t.Errorf("injected %q from a misplaced reply", f.net[i])
			}
		})
	}
}

// TestPlanRefusesImpossibleLiveAge: the age of the peer's live state comes from the peer's host. The
// restored TCP clock starts at the peer's last echo plus that age, so an age no honest peer reports (24
// days or more, where the clock wraps behind the echo and the peer's PAWS check stalls the connection for
// good; or so large that adding the time the answer took overflows) refuses the job.
func TestPlanRefusesImpossibleLiveAge(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	c := ckpt.Conn{Tuple: conn, InqSeq: 1000, OutqSeq: 5000, Timestamp: 2}
	for _, age := range []time.Duration{1 << 31 * time.Millisecond, 30 * 24 * time.Hour, math.MaxInt64} {
		peers := rangePeer{func(req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte) {
			l := ebpfprobes.FlowState{HasAck: true, Ack: 5000, SndNxt: 1000, HasTS: true, TSecr: 7000}
			return clusterapi.LogRangeReply{From: req.From, Live: &l, LiveAge: age}, nil
		}}
		j := &Job{ID: "rank1", Manifest: &ckpt.Manifest{Info: ckpt.Info{Conns: []ckpt.Conn{c}}}}
		err := plan(t.Context(), Deps{Peers: peers}, j, func(ckpt.Conn) bool { return false })
		if !errors.Is(err, restore.ErrNotRecoverable) {
			t.Errorf("live state %v old: plan = %v (timestamps %+v); want ErrNotRecoverable", age, err, j.Plan.Conns)
		}
	}
}
