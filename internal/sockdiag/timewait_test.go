package sockdiag

import (
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestLookupTimeWait: the end that closed first ends in TIME_WAIT once its peer's FIN arrived, and the
// kernel answers for it without tcp_info: Lookup gives its state (it took in its peer's FIN), not an error.
func TestLookupTimeWait(t *testing.T) {
	client, server := loopbackPair(t)
	conn := tcpflow.Tuple{Local: client.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: client.RemoteAddr().(*net.TCPAddr).AddrPort()}
	client.Close()
	if _, err := io.ReadAll(server); err != nil {
		t.Fatal(err)
	}
	server.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := Lookup(conn)
		if err != nil {
			t.Fatalf("the end that closed first: %v", err)
		}
		if s.TimeWait() {
			if !s.FinReceived() {
				t.Errorf("in TIME_WAIT, yet FinReceived is false")
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the end that closed first is in state %d, not TIME_WAIT", s.State)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestParseDiagReplyWithoutInfo: only a TIME_WAIT socket's reply may lack tcp_info.
func TestParseDiagReplyWithoutInfo(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("0.0.0.0:0"), Remote: netip.MustParseAddrPort("0.0.0.0:0")} // as the reply names it
	reply := func(state uint8) []byte {
		b := make([]byte, sizeofNlMsghdr+sizeofInetDiagMsg)
		binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
		binary.NativeEndian.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
		b[sizeofNlMsghdr+1] = state
		return b
	}
	if s, err := parseDiagReply(reply(stateTimeWait), conn); err != nil || !s.TimeWait() {
		t.Errorf("TIME_WAIT without tcp_info: %+v, %v; want its state", s, err)
	}
	if _, err := parseDiagReply(reply(stateCloseWait), conn); err == nil || !strings.Contains(err.Error(), "without tcp_info") {
		t.Errorf("CLOSE_WAIT without tcp_info: %v; want refused", err)
	}
}
