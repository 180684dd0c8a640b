package agent

import (
	"log/slog"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/node"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestServeReceivedFIN: the record this host serves of what one of its sockets received says where the
// sender's FIN was when the socket took it in and this host acknowledged it right at the record's end;
// otherwise (no FIN taken, not acknowledged there, the socket gone) it says nothing of a FIN, and the
// recovery refuses a FIN it cannot check, as before.
func TestServeReceivedFIN(t *testing.T) {
	// Named as the sender names it: Local is the remote sender, Remote this host's socket.
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	const start, n = 1000, 5000
	end := uint32(start + n)
	const (
		established = 1
		timeWait    = 6
		closeWait   = 8
	)
	tests := []struct {
		name    string
		state   uint8
		gone    bool
		ack     uint32 // this host's last ACK on the reverse flow
		wantFin bool
	}{
		{name: "CLOSE_WAIT, FIN acknowledged at the record's end", state: closeWait, ack: end + 1, wantFin: true},
		{name: "TIME_WAIT, FIN acknowledged at the record's end", state: timeWait, ack: end + 1, wantFin: true},
		{name: "no FIN taken in", state: established, ack: end + 1},
		{name: "FIN not acknowledged (yet)", state: closeWait, ack: end},
		{name: "FIN acknowledged past the record's end", state: closeWait, ack: end + 2},
		{name: "socket gone", gone: true, ack: end + 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			nd, err := node.New(isnSource{fs: ebpfprobes.FlowState{HasAck: true, Ack: tt.ack}},
				node.Config{Controller: controller.Config{Cap: 1 << 20}, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			book := recvdigest.NewBook(recvdigest.BookOptions{})
			book.Add(netlog.Record{Conn: conn, Seq: start}) // where the flow's bytes begin, as the tap says at the SYN
			book.Add(netlog.Record{Conn: conn, Seq: start, Payload: make([]byte, n)})
			var asked tcpflow.Tuple
			socket := func(f tcpflow.Tuple) (sockdiag.Socket, error) {
				asked = f
				if tt.gone {
					return sockdiag.Socket{}, sockdiag.ErrNoSocket
				}
				return sockdiag.Socket{State: tt.state}, nil
			}
			a := &Agent{log: slog.New(slog.DiscardHandler), netlog: &logState{node: nd, book: book, socket: socket}}
			rep, err := a.serveReceived(clusterapi.ReceivedRequest{Tuple: conn, From: start + 10})
			if err != nil {
				t.Fatal(err)
			}
			if asked != conn.Reverse() {
				t.Errorf("asked for socket %s, want this host's end %s", asked, conn.Reverse())
			}
			if err := rep.Check(clusterapi.ReceivedRequest{Tuple: conn}); err != nil {
				t.Fatalf("the reply fails the asker's check: %v", err)
			}
			switch fin := rep.Received.Fin; {
			case tt.wantFin && (fin == nil || *fin != end):
				t.Errorf("FIN %v, want at %d", fin, end)
			case !tt.wantFin && fin != nil:
				t.Errorf("FIN at %d, want none", *fin)
			}
		})
	}
}

// TestServeReceivedMapped: a record is found whichever form the asker names the connection in. The tap
// records IPv4 headers, but the restored end's images name a dual-stack socket's IPv4 connection by
// IPv4-mapped addresses (::ffff:a.b.c.d), and the recovery asks in that form: the record is served, named
// as asked so that the asker's check passes. Before, such a connection had "no record", and every re-sent
// byte on it was refused as unverifiable.
func TestServeReceivedMapped(t *testing.T) {
	plain := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	mapped := tcpflow.Tuple{Local: netip.MustParseAddrPort("[::ffff:10.0.0.2]:7000"), Remote: netip.MustParseAddrPort("[::ffff:10.0.0.1]:40000")}
	const start, n = 1000, 5000
	for _, ask := range []tcpflow.Tuple{plain, mapped} {
		t.Run(ask.String(), func(t *testing.T) {
			nd, err := node.New(isnSource{}, node.Config{Controller: controller.Config{Cap: 1 << 20}, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			book := recvdigest.NewBook(recvdigest.BookOptions{})
			book.Add(netlog.Record{Conn: plain, Seq: start}) // the tap's IPv4 form
			book.Add(netlog.Record{Conn: plain, Seq: start, Payload: make([]byte, n)})
			socket := func(tcpflow.Tuple) (sockdiag.Socket, error) { return sockdiag.Socket{State: 1}, nil }
			a := &Agent{log: slog.New(slog.DiscardHandler), netlog: &logState{node: nd, book: book, socket: socket}}
			req := clusterapi.ReceivedRequest{Tuple: ask, From: start + 10}
			rep, err := a.serveReceived(req)
			if err != nil {
				t.Fatalf("record of %s: %v", ask, err)
			}
			if err := rep.Check(req); err != nil {
				t.Fatalf("the reply fails the asker's check: %v", err)
			}
			if got := len(rep.Received.Pieces); got == 0 {
				t.Errorf("record of %s has no piece, want the %d bytes received", ask, n)
			}
		})
	}
}
