package agent

import (
	"context"
	"encoding/json"
	"errors"
	"hash/crc32"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/node"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestPrefixExtends: a snapshot's SentPrefix is the CRC-32C of the bytes before write_seq in its digest
// block; a later dump in the same block extends it with the bytes sent in between and gets the prefix the
// receiver's record needs, whether the earlier prefix started at the block start or at the connection's
// first byte. A dump in a later block, before the earlier one, or an earlier snapshot without a prefix
// gives nothing to extend.
func TestPrefixExtends(t *testing.T) {
	stream := make([]byte, 3*recvdigest.BlockSize)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range stream {
		stream[i] = byte(r.Uint32())
	}
	const seq0 = 7 * recvdigest.BlockSize // wire sequence of stream[0]
	crcOf := func(from, to uint32) uint32 { return crc32.Checksum(stream[from-seq0:to-seq0], castagnoli) }
	block := uint32(seq0 + recvdigest.BlockSize)
	tests := []struct {
		name       string
		first      uint32 // the connection's first byte, where the prefixes start if inside the block
		base, outq uint32
		noPrefix   bool
		want       bool
		wantFrom   uint32 // where the new prefix starts
	}{
		{name: "nothing sent since (a one-way stream's receiving side)", first: seq0, base: block + 1000, outq: block + 1000, want: true, wantFrom: block},
		{name: "bytes sent since, same block", first: seq0, base: block + 1000, outq: block + 50000, want: true, wantFrom: block},
		{name: "first byte inside the block", first: block + 300, base: block + 1000, outq: block + 4000, want: true, wantFrom: block + 300},
		{name: "base at the block start", first: seq0, base: block, outq: block + 10, want: true, wantFrom: block},
		{name: "later block", first: seq0, base: block + 1000, outq: block + recvdigest.BlockSize + 5},
		{name: "before the base", first: seq0, base: block + 1000, outq: block + 999},
		{name: "base without a prefix", first: seq0, base: block + 1000, outq: block + 2000, noPrefix: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bstart := max(recvdigest.BlockStart(tt.base), tt.first)
			b := ckpt.Conn{OutqSeq: tt.base}
			if !tt.noPrefix {
				b.SentPrefix = &ckpt.SentPrefix{Len: tt.base - bstart, CRC: crcOf(bstart, tt.base)}
			}
			pb, ok := prefixExtends(b, tt.outq)
			if ok != tt.want {
				t.Fatalf("prefixExtends = %v, want %v", ok, tt.want)
			}
			if !ok {
				return
			}
			h := crc32New(pb.CRC)
			h.Write(stream[pb.From-seq0 : tt.outq-seq0])
			gotLen := pb.Len + (tt.outq - pb.From)
			if wantLen := tt.outq - tt.wantFrom; gotLen != wantLen {
				t.Errorf("prefix length %d, want %d", gotLen, wantLen)
			}
			if want := crcOf(tt.wantFrom, tt.outq); h.Sum32() != want {
				t.Errorf("prefix CRC %08x, want %08x (the receiver's bytes from %d to write_seq)", h.Sum32(), want, tt.wantFrom)
			}
		})
	}
}

// TestPrefixBase: on the host a job was restored on, the prefix of a new dump extends the newest
// snapshot of this copy of the job: the one it was restored from, or one taken here since; never an
// older snapshot of another copy, nor one another host took.
func TestPrefixBase(t *testing.T) {
	dir := t.TempDir()
	open := func(node string) *ckpt.Store {
		s, err := ckpt.Open(dir, ckpt.Options{Node: node})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	const job = "relay-1a2b3c4d"
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.13:7700"), Remote: netip.MustParseAddrPort("10.0.0.12:50930")}
	other := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.13:40000"), Remote: netip.MustParseAddrPort("10.0.0.14:7700")}
	const block = 5 * recvdigest.BlockSize
	var rec Job // the job record the next snapshot carries
	snap := func(s *ckpt.Store, outq, crc uint32) *ckpt.Manifest {
		t.Helper()
		p, err := s.Begin(job)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p.Dir(), "pages-1.img"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		b, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p.Dir(), snapJob), b, 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := p.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0", Mode: ckpt.ModeUncoordinated,
			Conns: []ckpt.Conn{
				{Tuple: other, OutqSeq: block + 1, SentPrefix: &ckpt.SentPrefix{Len: 1, CRC: 1}},
				{Tuple: conn, OutqSeq: outq, SentPrefix: &ckpt.SentPrefix{Len: outq - block, CRC: crc}},
			}})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	node3 := open("node3")
	older := snap(node3, block+100, 0x100)
	restoredFrom := snap(node3, block+200, 0x200)
	spare1 := open("spare1")
	a := &Agent{store: spare1, log: slog.New(slog.DiscardHandler)}
	a.cfg.Name = "spare1"
	j := Job{ID: job, Restored: restoredFrom.ID}

	if b, ok := prefixBaseOf(a.copySnapshots(j), conn, block+200); !ok || b != (prefixBase{From: block + 200, Len: 200, CRC: 0x200}) {
		t.Errorf("right after the restore: base %+v %v, want the restored snapshot's prefix", b, ok)
	}
	if _, ok := prefixBaseOf(a.copySnapshots(j), conn, block+150); ok {
		t.Errorf("a dump before the restored snapshot's write_seq found a base (%s, another copy's?)", older.ID)
	}
	if _, ok := prefixBaseOf(a.copySnapshots(Job{ID: job, Restored: restoredFrom.ID}), tcpflow.Tuple{Local: conn.Local, Remote: netip.MustParseAddrPort("10.0.0.12:50931")}, block+200); ok {
		t.Errorf("another connection found a base")
	}
	rec = j // taken by this copy
	here := snap(spare1, block+300, 0x300)
	if b, ok := prefixBaseOf(a.copySnapshots(j), conn, block+400); !ok || b.From != block+300 || b.CRC != 0x300 {
		t.Errorf("after a snapshot here: base %+v %v, want snapshot %s's", b, ok, here.ID)
	}
	// A newer snapshot another host took (this host protects a later copy) is not this copy's.
	snap(open("node4"), block+500, 0x500)
	if b, ok := prefixBaseOf(a.copySnapshots(j), conn, block+600); !ok || b.From != block+300 {
		t.Errorf("with another host's newer snapshot: base %+v %v, want snapshot %s's", b, ok, here.ID)
	}
}

// isnSource is a node.Source whose only answer is a flow state with a known ISN.
type isnSource struct{ fs ebpfprobes.FlowState }

func (s isnSource) Log() *netlog.Log { return nil }
func (s isnSource) FlowState(tcpflow.Tuple) (ebpfprobes.FlowState, bool, error) {
	return s.fs, true, nil
}
func (isnSource) LogsSocket(tcpflow.Tuple) (bool, error)          { return true, nil }
func (isnSource) Protects(uint64) bool                            { return true }
func (isnSource) ProtectCgroup(string) error                      { return nil }
func (isnSource) UnprotectCgroup(string) error                    { return nil }
func (isnSource) Counters() (capture.Counters, error)             { return capture.Counters{}, errors.New("none") }
func (isnSource) Urge() func()                                    { return func() {} }
func (isnSource) Want(tcpflow.Tuple)                              {}
func (isnSource) TakeParked(context.Context, tcpflow.Tuple) error { return nil }
func (isnSource) Close() error                                    { return nil }

// TestSentPrefixISNFarBack: a connection that sent 2 to 4 GiB (mod 4 GiB) before write_seq has its first
// byte more than 2^31 bytes behind write_seq's block, not inside it. With write_seq at a block start the
// prefix is empty. Before, a signed difference took ISN+1 for a byte inside the block: the prefix asked
// for 3 GiB of sent bytes, the snapshot went without one, and its re-sent bytes were unverifiable.
func TestSentPrefixISNFarBack(t *testing.T) {
	const outq = 100 * recvdigest.BlockSize // write_seq at a block boundary
	for _, back := range []uint32{3<<30 + 1, 1<<31 + 5} {
		n, err := node.New(isnSource{fs: ebpfprobes.FlowState{HasISN: true, ISN: uint32(outq) - back}},
			node.Config{Controller: controller.Config{Cap: 1 << 20}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		store, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: "node1"})
		if err != nil {
			t.Fatal(err)
		}
		a := &Agent{store: store, log: slog.New(slog.DiscardHandler), netlog: &logState{node: n}}
		a.cfg.Name = "node1"
		c := image.TCPConn{Inode: 1, OutqSeq: outq}
		c.Tuple = tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:5000"), Remote: netip.MustParseAddrPort("10.0.0.2:6000")}
		p, err := a.sentPrefix(context.Background(), t.TempDir(), c, func() []*ckpt.Manifest { return a.copySnapshots(Job{ID: "j-1"}) })
		if err != nil || p.Len != 0 {
			t.Errorf("ISN+1 %d bytes before write_seq at a block start: prefix %+v, %v; want an empty one", back-1, p, err)
		}
	}
}

// TestPrefixBaseOtherCopy: the snapshots this host took of an earlier copy of the job are not this copy's,
// whatever the clocks say. Snapshot ids carry their host's clock: with this host's ahead of the one the job
// was restored from, or with a restore here from an older snapshot of this host (a manual restore past a
// corrupt newest one, a rollback), an earlier copy's snapshot sorts after the restored one and used to pass
// for this copy's: the new prefix extended bytes this copy never sent (another execution's, or bytes
// this host's log cannot have: a 5 s wait and no prefix), and the next recovery refused the job.
func TestPrefixBaseOtherCopy(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.13:7700"), Remote: netip.MustParseAddrPort("10.0.0.12:50930")}
	const job = "relay-1a2b3c4d"
	const block = 5 * recvdigest.BlockSize
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		// restoredNode took the snapshot the job was restored here from, at restoredAt by its clock;
		// spare1 took the earlier copy's snapshot at earlierAt, and this copy's at hereAt, by its own.
		restoredNode                  string
		restoredAt, earlierAt, hereAt time.Time
		earlierInc                    uint64 // the incarnation of the earlier copy
	}{
		// The job ran here (incarnation 0), then on node3 (1), and came back (2).
		{name: "this host's clock 10 min ahead", restoredNode: "node3", restoredAt: t0,
			earlierAt: t0.Add(-5 * time.Minute).Add(10 * time.Minute), hereAt: t0.Add(2 * time.Minute).Add(10 * time.Minute)},
		{name: "this host's clock 30 min behind", restoredNode: "node3", restoredAt: t0,
			earlierAt: t0.Add(-5 * time.Minute).Add(-30 * time.Minute), hereAt: t0.Add(2 * time.Minute).Add(-30 * time.Minute)},
		// Incarnation 1 ran here and took the restored snapshot, then a newer one; incarnation 2 was restored
		// here from the older.
		{name: "restored here from an older snapshot of this host", restoredNode: "spare1", restoredAt: t0,
			earlierAt: t0.Add(time.Minute), hereAt: t0.Add(5 * time.Minute), earlierInc: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			snap := func(node string, at time.Time, rec Job, outq, crc uint32) *ckpt.Manifest {
				t.Helper()
				s, err := ckpt.Open(dir, ckpt.Options{Node: node, Now: func() time.Time { return at }})
				if err != nil {
					t.Fatal(err)
				}
				p, err := s.Begin(job)
				if err != nil {
					t.Fatal(err)
				}
				b, err := json.Marshal(rec)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(p.Dir(), snapJob), b, 0o600); err != nil {
					t.Fatal(err)
				}
				m, err := p.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0", Mode: ckpt.ModeUncoordinated,
					Conns: []ckpt.Conn{{Tuple: conn, OutqSeq: outq, SentPrefix: &ckpt.SentPrefix{Len: outq - block, CRC: crc}}}})
				if err != nil {
					t.Fatal(err)
				}
				return m
			}
			restoredFrom := snap(tt.restoredNode, tt.restoredAt, Job{ID: job, Incarnation: 1}, block+200, 0x200)
			earlier := snap("spare1", tt.earlierAt, Job{ID: job, Incarnation: tt.earlierInc}, block+300, 0x300)
			store, err := ckpt.Open(dir, ckpt.Options{Node: "spare1"})
			if err != nil {
				t.Fatal(err)
			}
			a := &Agent{store: store, log: slog.New(slog.DiscardHandler)}
			a.cfg.Name = "spare1"
			j := Job{ID: job, Restored: restoredFrom.ID, Incarnation: 2}
			if b, ok := prefixBaseOf(a.copySnapshots(j), conn, block+400); !ok || b.From != block+200 || b.CRC != 0x200 {
				t.Fatalf("base %+v %v, want the restored snapshot %s's, not the earlier copy's %s", b, ok, restoredFrom.ID, earlier.ID)
			}
			// This copy's own snapshot here is taken, whatever the other host's clock said.
			here := snap("spare1", tt.hereAt, j, block+350, 0x350)
			if b, ok := prefixBaseOf(a.copySnapshots(j), conn, block+400); !ok || b.From != block+350 || b.CRC != 0x350 {
				t.Errorf("after a snapshot of this copy here: base %+v %v, want snapshot %s's", b, ok, here.ID)
			}
		})
	}
}
