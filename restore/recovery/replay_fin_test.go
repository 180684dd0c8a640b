package recovery

import (
	"errors"
	"hash/crc32"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestReplayAndVerifyOwnFIN: the job sent 3000 bytes and its FIN after its snapshot, and its peer took
// them all in (its ACK, the plan's resend, counts the FIN). The restored job re-sends both; the check
// passes if the peer's record has the FIN where the job re-sent its own, after the same bytes. Before,
// the FIN's sequence number, which no receive record holds as a byte, failed every such recovery.
func TestReplayAndVerifyOwnFIN(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	const data = 3000
	stream := make([]byte, data)
	for i := range stream {
		stream[i] = byte(i * 7)
	}
	fin := uint32(data)
	pieces := []recvdigest.Piece{{Seq: 0, Len: data, CRC: crc32.Checksum(stream, crc32.MakeTable(crc32.Castagnoli))}}
	tests := []struct {
		name    string
		peerFin *uint32 // the peer's record of the job's FIN
		ownFin  *uint32 // where the restored job re-sent its FIN
		wantErr error   // nil: verified
		wantMsg string
	}{
		{name: "the FIN re-sent where the peer had it", peerFin: &fin, ownFin: &fin, wantMsg: "re-sent bytes verified: all 3000 on 1 connection(s)"},
		{name: "the peer does not report the FIN", ownFin: &fin, wantErr: recvdigest.ErrUnverified, wantMsg: "before what it acknowledged (3001)"},
		{name: "the restored job sent no FIN", peerFin: &fin, wantErr: recvdigest.ErrNondeterministic, wantMsg: "sent no FIN"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			d := f.deps()
			d.ReplayTimeout = 100 * time.Millisecond
			f.logged[conn] = stream
			f.sent[conn] = data + 1 // the FIN takes a sequence number
			f.finAt = map[tcpflow.Tuple]uint32{}
			if tt.ownFin != nil {
				f.finAt[conn] = *tt.ownFin
			}
			cp := restore.ConnPlan{Resend: data + 1}
			cp.Conn.Tuple = conn
			rec := &recvdigest.Received{Conn: conn, Pieces: pieces, Fin: tt.peerFin}
			j := &Job{ID: "rank1", Plan: restore.Plan{Conns: []restore.ConnPlan{cp}}, Checks: map[tcpflow.Tuple]Check{conn: {Received: rec}}}
			j.stopKeeping = f.Keep(j.Plan)
			detail, err := ReplayAndVerify(t.Context(), d, j)
			if tt.wantErr == nil && err != nil || tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("ReplayAndVerify = %q, %v; want %v", detail, err, tt.wantErr)
			}
			if !strings.Contains(detail+" "+errString(err), tt.wantMsg) {
				t.Errorf("detail %q, error %v; want %q in them", detail, err, tt.wantMsg)
			}
			if killed := len(f.killed) > 0; killed != (tt.wantErr != nil) {
				t.Errorf("killed %v; want killed %v", f.killed, tt.wantErr != nil)
			}
		})
	}
}
