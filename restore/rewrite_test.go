//go:build linux

package restore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	sk_opts "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-opts"
	tcp_stream "github.com/checkpoint-restore/go-criu/v7/crit/images/tcp-stream"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/tcpflow"
)

// CRIU image framing (criu/include/magic.h), for synthetic dumps.
const (
	magicCommon    = 0x54564319
	magicFiles     = 0x56303138
	magicTCPStream = 0x51465506
	magicInventory = 0x58313116
)

func appendEntry(b, payload []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(payload)))
	return append(b, payload...)
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// synthImage is one established IPv4 socket as CRIU 4.2.1 writes it.
type synthImage struct {
	inode                  uint32
	inqSeq, outqSeq        uint32
	inq, outq              []byte
	sndWnd, maxWnd, sndbuf uint32
	timestamp              uint32
	noWindow, noTimestamps bool
}

func (s synthImage) write(t *testing.T, dir string) ckpt.Conn {
	t.Helper()
	words := func(a [4]byte) []uint32 { return []uint32{binary.NativeEndian.Uint32(a[:])} }
	zero := &fown.FownEntry{Uid: proto.Uint32(0), Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)}
	fe := &fdinfo.FileEntry{Type: fdinfo.FdTypes_INETSK.Enum(), Id: proto.Uint32(1), Isk: &sk_inet.InetSkEntry{
		Id: proto.Uint32(1), Ino: proto.Uint32(s.inode), Family: proto.Uint32(2), Type: proto.Uint32(1), Proto: proto.Uint32(6),
		State: proto.Uint32(1), SrcPort: proto.Uint32(uint32(addrF.Port())), DstPort: proto.Uint32(uint32(addrP.Port())),
		Flags: proto.Uint32(2), Backlog: proto.Uint32(0),
		SrcAddr: words(addrF.Addr().As4()), DstAddr: words(addrP.Addr().As4()), Fown: zero,
		Opts: &sk_opts.SkOptsEntry{SoSndbuf: proto.Uint32(s.sndbuf), SoRcvbuf: proto.Uint32(131072),
			SoSndTmoSec: proto.Uint64(0), SoSndTmoUsec: proto.Uint64(0), SoRcvTmoSec: proto.Uint64(0), SoRcvTmoUsec: proto.Uint64(0)},
	}}
	files := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, magicCommon), magicFiles)
	files = appendEntry(files, mustMarshal(t, fe))
	optMask := uint32(1 | 2 | 4)
	if s.noTimestamps {
		optMask = 2 | 4
	}
	e := &tcp_stream.TcpStreamEntry{
		InqLen: proto.Uint32(uint32(len(s.inq))), InqSeq: proto.Uint32(s.inqSeq),
		OutqLen: proto.Uint32(uint32(len(s.outq))), OutqSeq: proto.Uint32(s.outqSeq),
		OptMask: proto.Uint32(optMask), SndWscale: proto.Uint32(7), MssClamp: proto.Uint32(1448), RcvWscale: proto.Uint32(7),
		Timestamp: proto.Uint32(s.timestamp), UnsqLen: proto.Uint32(0),
	}
	if !s.noWindow {
		e.SndWl1, e.SndWnd, e.MaxWindow = proto.Uint32(s.inqSeq), proto.Uint32(s.sndWnd), proto.Uint32(s.maxWnd)
		e.RcvWnd, e.RcvWup = proto.Uint32(65536), proto.Uint32(s.inqSeq)
	}
	stream := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, magicCommon), magicTCPStream)
	stream = appendEntry(stream, mustMarshal(t, e))
	stream = append(append(stream, s.inq...), s.outq...)
	for name, b := range map[string][]byte{"files.img": files, fmt.Sprintf("tcp-stream-%x.img", s.inode): stream} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return ckpt.Conn{Tuple: tcpflow.Tuple{Local: addrF, Remote: addrP}, Inode: uint64(s.inode), InqSeq: s.inqSeq, InqLen: uint32(len(s.inq)),
		OutqSeq: s.outqSeq, OutqLen: uint32(len(s.outq)), Timestamp: s.timestamp}
}

func onlyConn(t *testing.T, dir string) image.TCPConn {
	t.Helper()
	cs, err := image.TCPConnections(dir)
	if err != nil || len(cs) != 1 {
		t.Fatalf("TCPConnections = %v, %v; want one", cs, err)
	}
	return cs[0]
}

func TestRewrite(t *testing.T) {
	base := synthImage{inode: 0x2a, inqSeq: 1000, outqSeq: 5000, inq: []byte("abc"), outq: []byte("0123456789"),
		sndWnd: 1 << 20, maxWnd: 1 << 20, sndbuf: 1 << 24, timestamp: 400}
	tests := []struct {
		name    string
		img     synthImage
		peer    Peer
		seg     int
		edit    func(p *Plan) // what a recovery changes in the plan before Rewrite
		check   func(t *testing.T, before, after image.TCPConn)
		queue   string // the receive queue after Rewrite, if check is set
		wantErr string
	}{
		{
			name: "inject, timestamp; image windows and buffer already larger: kept",
			img:  base,
			peer: Peer{Live: live(1020, 5100, 900), Logged: logged(30)},
			seg:  1448,
			check: func(t *testing.T, before, after image.TCPConn) {
				if after.InqSeq != 1020 || after.InqLen != 23 || after.RcvWup != 1020 {
					t.Errorf("receive side %d+%d (rcv_wup %d), want 1020+23", after.InqSeq, after.InqLen, after.RcvWup)
				}
				if after.Timestamp != 900+1000 {
					t.Errorf("timestamp %d, want %d", after.Timestamp, 900+1000)
				}
				if after.SndWnd != before.SndWnd || after.MaxWindow != before.MaxWindow || after.SoSndbuf != before.SoSndbuf {
					t.Errorf("windows %d/%d sndbuf %d changed from %d/%d %d: must never be lowered",
						after.SndWnd, after.MaxWindow, after.SoSndbuf, before.SndWnd, before.MaxWindow, before.SoSndbuf)
				}
			},
		},
		{
			name: "small image windows and buffer raised for the re-sent range",
			img:  func() synthImage { s := base; s.sndWnd, s.maxWnd, s.sndbuf = 1000, 2000, 4096; return s }(),
			peer: Peer{Live: live(1000, 5000+4000, 900)},
			seg:  8,
			check: func(t *testing.T, before, after image.TCPConn) {
				burst := uint32(10 + 4000)
				if after.SndWnd < burst || after.MaxWindow < after.SndWnd || after.SoSndbuf < 2*burst+(burst/8)*SegmentOverhead {
					t.Errorf("windows %d/%d sndbuf %d: a %d-byte burst in 8-byte segments does not fit", after.SndWnd, after.MaxWindow, after.SoSndbuf, burst)
				}
				if after.InqSeq != before.InqSeq || after.Timestamp != 1900 {
					t.Errorf("inq_seq %d, timestamp %d: want %d, 1900", after.InqSeq, after.Timestamp, before.InqSeq)
				}
			},
		},
		{
			name: "deferred to a gate: the queue emptied, nothing injected",
			img:  base,
			peer: Peer{Live: live(1020, 5000, 900), Logged: logged(30)},
			seg:  1448,
			edit: func(p *Plan) { p.Conns[0].Deferred = true },
			check: func(t *testing.T, before, after image.TCPConn) {
				if after.InqSeq != 997 || after.InqLen != 0 {
					t.Errorf("receive side %d+%d, want 997+0: the gate delivers from the queue's first byte", after.InqSeq, after.InqLen)
				}
			},
		},
		{
			name: "deferred with a preload: the queue holds only it",
			img:  base,
			peer: Peer{Live: live(1020, 5000, 900), Logged: logged(30)},
			seg:  1448,
			edit: func(p *Plan) {
				p.Conns[0].Deferred = true
				p.Conns[0].Preload = append([]byte("abc"), p.Conns[0].Inject[:2]...)
			},
			check: func(t *testing.T, before, after image.TCPConn) {
				if after.InqSeq != 1002 || after.InqLen != 5 || after.RcvWup != 1002 {
					t.Errorf("receive side %d+%d (rcv_wup %d), want 1002+5", after.InqSeq, after.InqLen, after.RcvWup)
				}
			},
			queue: "abc\x01\x0e",
		},
		{
			name:    "no window data to raise",
			img:     func() synthImage { s := base; s.noWindow = true; return s }(),
			peer:    Peer{Live: live(1000, 5000+4000, 900)},
			seg:     8,
			wantErr: "no window data",
		},
		{
			name:    "peer uses timestamps, image does not",
			img:     func() synthImage { s := base; s.noTimestamps = true; return s }(),
			peer:    Peer{Live: live(1000, 5000, 900)},
			seg:     1448,
			wantErr: "did not negotiate",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			c := tt.img.write(t, dir)
			before := onlyConn(t, dir)
			p, err := NewPlan([]ckpt.Conn{c}, map[tcpflow.Tuple]Peer{c.Tuple: tt.peer}, tt.seg)
			if err != nil {
				t.Fatal(err)
			}
			if tt.edit != nil {
				tt.edit(&p)
			}
			err = Rewrite(dir, p)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				if after := onlyConn(t, dir); after != before {
					t.Errorf("a refused rewrite changed the images: %+v -> %+v", before, after)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, before, onlyConn(t, dir))
			if q, err := image.ReceiveQueue(dir, uint32(c.Inode)); err != nil || (tt.queue != "" && string(q) != tt.queue) {
				t.Errorf("receive queue %q, %v; want %q", q, err, tt.queue)
			}
		})
	}
}

func TestRewriteRefusesAnotherSnapshot(t *testing.T) {
	dir := t.TempDir()
	c := synthImage{inode: 5, inqSeq: 1000, outqSeq: 5000, sndWnd: 1000, maxWnd: 1000, sndbuf: 4096, timestamp: 2}.write(t, dir)
	stream := filepath.Join(dir, "tcp-stream-5.img")
	orig, err := os.ReadFile(stream)
	if err != nil {
		t.Fatal(err)
	}
	for name, mutate := range map[string]func(*ckpt.Conn){
		"inq_seq":   func(c *ckpt.Conn) { c.InqSeq++ },
		"outq_seq":  func(c *ckpt.Conn) { c.OutqSeq-- },
		"remote":    func(c *ckpt.Conn) { c.Remote = netipPort(c.Remote, 1) },
		"inode":     func(c *ckpt.Conn) { c.Inode = 6 },
		"timestamp": func(c *ckpt.Conn) { c.Timestamp = 4 },
	} {
		t.Run(name, func(t *testing.T) {
			m := c
			mutate(&m)
			cp, err := PlanConn(m, Peer{Live: live(m.InqSeq+10, m.OutqSeq, 10), Logged: logged(10)}, 1448)
			if err != nil {
				t.Fatal(err)
			}
			err = Rewrite(dir, Plan{Conns: []ConnPlan{cp}, InitCwnd: 10})
			if err == nil || !strings.Contains(err.Error(), "another snapshot") {
				t.Fatalf("error %v, want a refusal naming another snapshot", err)
			}
			if now, _ := os.ReadFile(stream); !bytes.Equal(now, orig) {
				t.Error("the refused rewrite changed the image")
			}
		})
	}
}

// TestRewriteRefusesPeerWithoutTimestamps: a socket that negotiated TCP timestamps keeps, unedited, the
// clock value of its snapshot, behind every TSval the peer took from the original since (its ts_recent):
// the peer's PAWS check would drop every segment of the restored socket, a connection stalled for good
// (and, with nothing to re-send, no replay that could time out). A peer state without timestamps for such a
// socket is the state of another connection, as is the reverse (refused already): refused before anything is
// written.
func TestRewriteRefusesPeerWithoutTimestamps(t *testing.T) {
	dir := t.TempDir()
	c := synthImage{inode: 0x2a, inqSeq: 1000, outqSeq: 5000, sndWnd: 1 << 20, maxWnd: 1 << 20, sndbuf: 1 << 24, timestamp: 400}.write(t, dir)
	before := onlyConn(t, dir)
	noTS := live(1020, 5000, 0)
	noTS.HasTS = false
	p, err := NewPlan([]ckpt.Conn{c}, map[tcpflow.Tuple]Peer{c.Tuple: {Live: noTS, Logged: logged(20)}}, 1448)
	if err != nil {
		t.Fatal(err)
	}
	err = Rewrite(dir, p)
	if !errors.Is(err, ErrNotRecoverable) || !strings.Contains(err.Error(), "timestamps") {
		t.Fatalf("Rewrite = %v; want ErrNotRecoverable naming the timestamps", err)
	}
	if after := onlyConn(t, dir); after != before {
		t.Errorf("a refused rewrite changed the images: %+v -> %+v", before, after)
	}
}

func netipPort(ap netip.AddrPort, d uint16) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr(), ap.Port()+d)
}

func writeInventory(t *testing.T, dir string, lock *uint32, runID string) {
	t.Helper()
	payload := mustMarshal(t, &inventory.InventoryEntry{ImgVersion: proto.Uint32(2), NetworkLockMethod: lock})
	if runID != "" {
		payload = protowire.AppendString(protowire.AppendTag(payload, 13, protowire.BytesType), runID)
	}
	b := appendEntry(binary.LittleEndian.AppendUint32(nil, magicInventory), payload)
	if err := os.WriteFile(filepath.Join(dir, "inventory.img"), b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestRunID(t *testing.T) {
	nft, ipt := uint32(image.NetworkLockNFTables), uint32(image.NetworkLockIPTables)
	const id = "7f05a1c5-eb5c-4010-8794-c7b4459a6353"
	tests := []struct {
		name    string
		lock    *uint32
		runID   string
		wantErr string
	}{
		{name: "nftables", lock: &nft, runID: id},
		{name: "iptables", lock: &ipt, runID: id, wantErr: "used the iptables network lock"},
		{name: "default lock is iptables", lock: nil, runID: id, wantErr: "iptables"},
		{name: "old CRIU", lock: &nft, runID: "", wantErr: "no run id"},
		{name: "not a uuid", lock: &nft, runID: "x; delete table inet filter", wantErr: "not a UUID"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			writeInventory(t, dir, tt.lock, tt.runID)
			got, err := RunID(dir)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("RunID = %q, %v; want error %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.runID {
				t.Fatalf("RunID = %q, %v; want %q", got, err, tt.runID)
			}
		})
	}
	if _, err := RunID(t.TempDir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RunID of a directory without inventory.img: %v", err)
	}
}
