//go:build linux

package ebpfprobes

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/tcpflow"
)

// readRecords returns the records waiting in l's ring.
func readRecords(t *testing.T, l *TCPLogger) []netlog.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	var recs []netlog.Record
	for {
		raw, err := l.Read(ctx)
		if err != nil {
			return recs
		}
		r, err := netlog.DecodeRecord(raw)
		if err != nil {
			t.Fatal(err)
		}
		r.Payload = append([]byte(nil), r.Payload...)
		recs = append(recs, r)
	}
}

// TestTCPLogFastOpenSYNData: a SYN that carries data (TCP Fast Open, Linux's tcp_send_syn_data) has its
// first payload byte at ISN + 1, the SYN itself taking ISN. The record must say so.
func TestTCPLogFastOpenSYNData(t *testing.T) {
	l := newTestLogger(t, 1<<20)
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40010"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}
	const isn = 5000
	if v := run(t, l, f, tcpframe.Segment{Seq: isn, Flags: TCPFlagSYN, Opts: synOpts(1), Payload: 100}); v != verdictNext {
		t.Fatalf("SYN-data: verdict %#x", v)
	}
	// The next data segment, as TCP sends it after the SYN-ACK.
	if v := run(t, l, f, tcpframe.Segment{Seq: isn + 1 + 100, Ack: 1, Flags: TCPFlagACK, Opts: tsOpt(2, 1), Payload: 50}); v != verdictNext {
		t.Fatalf("data: verdict %#x", v)
	}
	recs := readRecords(t, l)
	if len(recs) != 2 {
		t.Fatalf("%d records, want 2", len(recs))
	}
	if recs[0].Seq != isn+1 {
		t.Errorf("SYN-data record at seq %d, want %d (ISN + 1): its bytes are logged one sequence number early", recs[0].Seq, isn+1)
	}
	if end := recs[0].Seq + uint32(len(recs[0].Payload)); end != recs[1].Seq {
		t.Errorf("the log has a gap or overlap between the SYN's data (ends %d) and the next record (%d)", end, recs[1].Seq)
	}
}

// TestTCPLogVLANFrame: the program says it parses one in-frame 802.1Q tag; a protected flow's segment in
// such a frame must be logged (or at least counted), not passed silently.
func TestTCPLogVLANFrame(t *testing.T) {
	l := newTestLogger(t, 1<<20)
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40011"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}
	fr := tcpframe.Segment{Seq: 77, Ack: 1, Flags: TCPFlagACK, Opts: tsOpt(2, 1), Payload: 60}.Frame(f)
	tagged := append(append(append([]byte{}, fr[:12]...), 0x81, 0x00, 0x00, 0x64), fr[12:]...)
	ret, err := l.objs.Program.Run(&ebpf.RunOptions{Data: tagged})
	if err != nil {
		t.Fatal(err)
	}
	recs := readRecords(t, l)
	if len(recs) != 1 || recs[0].Seq != 77 || len(recs[0].Payload) != 60 {
		t.Errorf("verdict %#x, %d records for a tagged frame of a protected flow, want 1 of 60 bytes at 77", ret, len(recs))
	}
}
