package agent

import (
	"context"
	"encoding/json"
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/netlog"
)

const B = DigestBlockSize

func TestWholeBlocks(t *testing.T) {
	const epoch = uint64(1) << 32
	tests := []struct {
		name     string
		from, to uint64
		first, n uint64
	}{
		{"aligned, two whole", epoch, epoch + 2*B, epoch, 2},
		{"aligned, partial tail", epoch, epoch + 2*B + 5, epoch, 2},
		{"partial head skipped", epoch + 1, epoch + 3*B, epoch + B, 2},
		{"only a partial block", epoch + 10, epoch + B - 1, epoch + B, 0},
		{"empty", epoch + B, epoch + B, epoch + B, 0},
		{"across the wire wrap", 2*epoch - B - 7, 2*epoch + 2*B, 2*epoch - B, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			first, n := wholeBlocks(tt.from, tt.to)
			if first != tt.first || n != tt.n {
				t.Errorf("wholeBlocks(%d, %d) = %d, %d; want %d, %d", tt.from, tt.to, first, n, tt.first, tt.n)
			}
			if netlog.Wire(first)%B != 0 {
				t.Errorf("block start %d is not aligned on the wire", first)
			}
		})
	}
}

func TestResentBlocks(t *testing.T) {
	tests := []struct {
		name         string
		from, length uint32
		first        uint32
		n            int
	}{
		{"aligned", 3 * B, 2 * B, 3 * B, 2},
		{"unaligned head and tail", 3*B + 1, 3 * B, 4 * B, 2},
		{"shorter than the head", 3*B + 1, B - 2, 4 * B, 0},
		{"exactly to the boundary", 3*B + 1, B - 1, 4 * B, 0},
		{"nothing re-sent", 5 * B, 0, 5 * B, 0},
		{"wraps at 2^32", 1<<32 - B - 100, 3*B + 100, 1<<32 - B, 3},
		{"starts at the wrap", 0, B, 0, 1},
		{"unaligned just below the wrap", 1<<32 - 1, 2 * B, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			first, n := resentBlocks(tt.from, tt.length)
			if n != tt.n || (n > 0 && first != tt.first) {
				t.Errorf("resentBlocks(%d, %d) = %d, %d; want %d, %d", tt.from, tt.length, first, n, tt.first, tt.n)
			}
			// Every block lies inside the range (in wrapping arithmetic).
			for i := range n {
				s := first + uint32(i)*B
				if s-tt.from > tt.length || s+B-tt.from > tt.length {
					t.Errorf("block %d [%d, %d) outside [%d, +%d)", i, s, s+B, tt.from, tt.length)
				}
			}
		})
	}
}

var (
	testSrc = netip.MustParseAddrPort("10.0.0.2:40000")
	testDst = netip.MustParseAddrPort("10.0.0.3:7300")
)

// stream is n deterministic pseudo-random bytes.
func stream(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func crcOfBytes(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// TestDigestNew logs a stream that starts mid-block and wraps at 2^32, and checks that the digester
// digests exactly the whole blocks, each once, with the CRC of the bytes sent.
func TestDigestNew(t *testing.T) {
	l, err := netlog.NewLog(netlog.Options{SlabSize: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	conn := netlog.Conn{Src: testSrc, Dst: testDst}
	start := uint32(1<<32 - B - 1000) // 1000 bytes of a partial block, then whole blocks across the wrap
	data := stream(6*B, 7)
	appendUpTo := func(from, to int) {
		for off := from; off < to; off += 1448 {
			end := min(off+1448, to)
			if err := l.Append(netlog.Record{Conn: conn, Seq: start + uint32(off), Payload: data[off:end]}); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := func(i int) BlockDigest { // the i-th whole block of the stream
		off := 1000 + i*B
		return BlockDigest{Src: testSrc, Dst: testDst, Seq: start + uint32(off), CRC: crcOfBytes(data[off : off+B])}
	}
	var d digester
	ctx := context.Background()

	appendUpTo(0, 1000+2*B+17) // two whole blocks and a partial one
	d.digestNew(ctx, l, 100)
	if len(d.pending) != 2 || d.pending[0] != want(0) || d.pending[1] != want(1) {
		t.Fatalf("first pass: %+v, want blocks 0 and 1", d.pending)
	}
	if d.pending[1].Seq != 0 {
		t.Errorf("second block should start at wire sequence 0 (the wrap), got %d", d.pending[1].Seq)
	}
	d.pending = nil
	d.digestNew(ctx, l, 100)
	if len(d.pending) != 0 {
		t.Fatalf("nothing new logged, yet digested %+v", d.pending)
	}
	appendUpTo(1000+2*B+17, 6*B) // completes blocks 2, 3, 4
	d.digestNew(ctx, l, 2)       // the per-tick limit holds back block 4
	if len(d.pending) != 2 || d.pending[0] != want(2) || d.pending[1] != want(3) {
		t.Fatalf("limited pass: %+v, want blocks 2 and 3", d.pending)
	}
	d.digestNew(ctx, l, 100)
	if len(d.pending) != 3 || d.pending[2] != want(4) {
		t.Fatalf("last pass: %+v, want block 4 added", d.pending)
	}
	// A reset (new protector) digests everything still logged again.
	d.reset()
	d.digestNew(ctx, l, 100)
	if len(d.pending) != 5 {
		t.Errorf("after reset: %d digests, want 5", len(d.pending))
	}
}

func TestRunsRoundTrip(t *testing.T) {
	tests := []struct {
		name   string
		seqs   []uint32
		newest uint32
		runs   int
	}{
		{"one run", []uint32{B, 2 * B, 3 * B}, 3 * B, 1},
		{"a gap", []uint32{B, 2 * B, 5 * B}, 5 * B, 2},
		{"across the wrap", []uint32{1<<32 - 2*B, 1<<32 - B, 0, B}, B, 1},
		{"single", []uint32{7 * B}, 7 * B, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			blocks := map[uint32]uint32{}
			for i, s := range tt.seqs {
				blocks[s] = uint32(i)*0x01010101 + 0xabc
			}
			cd := ConnDigests{Src: testSrc, Dst: testDst, Runs: encodeRuns(blocks, tt.newest)}
			if len(cd.Runs) != tt.runs {
				t.Errorf("%d runs, want %d: %+v", len(cd.Runs), tt.runs, cd.Runs)
			}
			b, err := json.Marshal(cd)
			if err != nil {
				t.Fatal(err)
			}
			var back ConnDigests
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			got, newest, err := back.index()
			if err != nil {
				t.Fatal(err)
			}
			if newest != tt.newest || len(got) != len(blocks) {
				t.Errorf("newest %d (want %d), %d blocks (want %d)", newest, tt.newest, len(got), len(blocks))
			}
			for s, c := range blocks {
				if got[s] != c {
					t.Errorf("block %d: crc %x, want %x", s, got[s], c)
				}
			}
		})
	}
}

func TestIndexRefusesMalformedRuns(t *testing.T) {
	tests := []struct {
		name string
		run  DigestRun
	}{
		{"unaligned", DigestRun{Seq: 5, CRCs: make([]byte, 4)}},
		{"torn CRC", DigestRun{Seq: B, CRCs: make([]byte, 6)}},
		{"too many blocks", DigestRun{Seq: 0, CRCs: make([]byte, 4*(maxDigestBlocksPerConn+1))}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, _, err := (ConnDigests{Runs: []DigestRun{tt.run}}).index(); err == nil {
				t.Error("accepted")
			}
		})
	}
}

func TestCheckResent(t *testing.T) {
	conn := netlog.Conn{Src: testSrc, Dst: testDst}
	sent := stream(4*B+300, 3) // what the peer received, from wire sequence base
	tests := []struct {
		name     string
		base     uint32
		from     uint32 // offset of the re-sent range in sent
		length   uint32
		corrupt  int  // offset of a byte the restored job re-sends differently (-1: none)
		drop     int  // block index without a digest (-1: none)
		unlogged bool // the target's log cannot give the bytes
		want     resentCheck
		mismatch int // block index of the expected mismatch (-1: none)
	}{
		{name: "deterministic", base: 100 * B, from: 0, length: 4 * B, corrupt: -1, drop: -1, want: resentCheck{Blocks: 4, Verified: 4}, mismatch: -1},
		{name: "partial ends are not checked", base: 100*B + 300, from: 0, length: 4*B - 100, corrupt: 10, drop: -1, want: resentCheck{Blocks: 3, Verified: 3}, mismatch: -1},
		{name: "different byte", base: 100 * B, from: 0, length: 4 * B, corrupt: 2*B + 5, drop: -1, want: resentCheck{Blocks: 4, Verified: 2}, mismatch: 2},
		{name: "different byte across the wrap", base: 1<<32 - 2*B, from: 0, length: 4 * B, corrupt: 2 * B, drop: -1, want: resentCheck{Blocks: 4, Verified: 2}, mismatch: 2},
		{name: "no digest for the changed block", base: 100 * B, from: 0, length: 4 * B, corrupt: B + 1, drop: 1, want: resentCheck{Blocks: 4, Verified: 3, NoDigest: 1}, mismatch: -1},
		{name: "not logged is never verified", base: 100 * B, from: 0, length: 4 * B, corrupt: -1, drop: -1, unlogged: true, want: resentCheck{Blocks: 4, NotLogged: 4}, mismatch: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			digests := map[uint32]uint32{}
			first, n := resentBlocks(tt.base, uint32(len(sent)))
			for i := range n {
				if i == tt.drop {
					continue
				}
				off := first + uint32(i)*B - tt.base
				digests[first+uint32(i)*B] = crcOfBytes(sent[off : off+B])
			}
			resent := append([]byte(nil), sent...)
			if tt.corrupt >= 0 {
				resent[tt.corrupt] ^= 0x5a
			}
			crcOf := func(seq uint32) (uint32, error) {
				if tt.unlogged {
					return 0, netlog.ErrHole
				}
				off := seq - tt.base
				return crcOfBytes(resent[off : off+B]), nil
			}
			got, err := checkResent(conn, tt.base+tt.from, tt.length, digests, crcOf)
			if got != tt.want {
				t.Errorf("check %+v, want %+v", got, tt.want)
			}
			if tt.mismatch < 0 {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			var me *MismatchError
			if !errors.As(err, &me) || !errors.Is(err, ErrNondeterministic) {
				t.Fatalf("error %v, want a MismatchError", err)
			}
			wantFrom := first + uint32(tt.mismatch)*B
			if me.From != wantFrom || me.To != wantFrom+B || me.Got == me.Want || me.Conn != conn {
				t.Errorf("mismatch %+v, want block [%d, %d)", me, wantFrom, wantFrom+B)
			}
		})
	}
}

func TestDigestStore(t *testing.T) {
	dir := t.TempDir()
	s, err := openDigestStore(dir, testLogger{t})
	if err != nil {
		t.Fatal(err)
	}
	var ds []BlockDigest
	for i := range 10 {
		ds = append(ds, BlockDigest{Src: testSrc, Dst: testDst, Seq: 1<<32 - 5*B + uint32(i)*B, CRC: uint32(i + 1)})
	}
	other := netip.MustParseAddrPort("10.0.0.4:7300")
	ds = append(ds, BlockDigest{Src: testSrc, Dst: other, Seq: 3 * B, CRC: 99})
	s.add("node2", ds, time.Now())

	// A snapshot whose write_seq is in the middle of block 3 (wire 1<<32-2B) makes blocks 0..2 useless.
	s.prune("node2", []ckpt.Conn{{Local: testSrc, Remote: testDst, OutqSeq: 1<<32 - 2*B + 10}})
	cds := s.forRecovery("node2", []ckpt.Conn{{Local: testSrc, Remote: testDst, OutqSeq: 1<<32 - B}})
	if len(cds) != 1 {
		t.Fatalf("recovery digests for one connection: %+v", cds)
	}
	blocks, _, err := cds[0].index()
	if err != nil {
		t.Fatal(err)
	}
	if len(blocks) != 6 || blocks[1<<32-B] != 5 || blocks[4*B] != 10 {
		t.Errorf("recovery digests %v, want blocks 4..9 (wire 2^32-B .. 4B)", blocks)
	}

	if err := s.flush(); err != nil {
		t.Fatal(err)
	}
	re, err := openDigestStore(dir, testLogger{t})
	if err != nil {
		t.Fatal(err)
	}
	if got := re.forRecovery("node2", []ckpt.Conn{{Local: testSrc, Remote: other, OutqSeq: 0}}); len(got) != 1 {
		t.Errorf("reloaded digests of the second connection: %+v", got)
	}
	if got := re.forRecovery("node2", []ckpt.Conn{{Local: testSrc, Remote: testDst, OutqSeq: 1<<32 - 3*B}}); len(got) != 1 || len(got[0].Runs) != 1 || len(got[0].Runs[0].CRCs) != 4*7 {
		t.Errorf("reloaded digests after the prune: %+v, want blocks 3..9", got)
	}
	if err := re.drop("node2"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "node2.json")); !os.IsNotExist(err) {
		t.Errorf("dropped node's file still there: %v", err)
	}
	if got := re.forRecovery("node2", []ckpt.Conn{{Local: testSrc, Remote: other}}); got != nil {
		t.Errorf("dropped node still has digests: %+v", got)
	}
}

func TestDigestStoreBounds(t *testing.T) {
	s, err := openDigestStore(t.TempDir(), testLogger{t})
	if err != nil {
		t.Fatal(err)
	}
	var ds []BlockDigest
	for i := range maxDigestBlocksPerConn + 100 {
		ds = append(ds, BlockDigest{Src: testSrc, Dst: testDst, Seq: uint32(i) * B, CRC: uint32(i)})
	}
	s.add("node2", ds, time.Now())
	cb := s.nodes["node2"].conns[netlog.Conn{Src: testSrc, Dst: testDst}]
	if len(cb.crc) != maxDigestBlocksPerConn {
		t.Fatalf("%d blocks kept, want the newest %d", len(cb.crc), maxDigestBlocksPerConn)
	}
	if _, ok := cb.crc[99*B]; ok {
		t.Error("an old block survived the cap")
	}
	if _, ok := cb.crc[100*B]; !ok {
		t.Error("the oldest block within the cap was dropped")
	}
	// Per node: the connections updated longest ago go first.
	for i := range maxDigestBlocksPerNode/maxDigestBlocksPerConn + 1 {
		dst := netip.AddrPortFrom(testDst.Addr(), uint16(8000+i))
		var more []BlockDigest
		for j := range maxDigestBlocksPerConn {
			more = append(more, BlockDigest{Src: testSrc, Dst: dst, Seq: uint32(j) * B})
		}
		s.add("node2", more, time.Now().Add(time.Duration(i+1)*time.Second))
	}
	total := 0
	for _, cb := range s.nodes["node2"].conns {
		total += len(cb.crc)
	}
	if total > maxDigestBlocksPerNode {
		t.Errorf("node keeps %d blocks, cap %d", total, maxDigestBlocksPerNode)
	}
	if _, ok := s.nodes["node2"].conns[netlog.Conn{Src: testSrc, Dst: testDst}]; ok {
		t.Error("the connection updated longest ago was kept")
	}
}

type testLogger struct{ t *testing.T }

func (l testLogger) Warn(msg string, args ...any) { l.t.Log(append([]any{msg}, args...)...) }

// FuzzConnDigests decodes a recovery request's digests: malformed input is refused, never a panic, and
// what is accepted survives a round trip.
func FuzzConnDigests(f *testing.F) {
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","runs":[{"seq":65536,"crcs":"AAAAAQAAAAI="}]}`))
	f.Add([]byte(`{"runs":[{"seq":4294901760,"crcs":"AAAAAQAAAAI="},{"seq":0,"crcs":""}]}`))
	f.Add([]byte(`{"runs":[{"seq":3,"crcs":"AAA="}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var cd ConnDigests
		if json.Unmarshal(b, &cd) != nil {
			return
		}
		blocks, newest, err := cd.index()
		if err != nil {
			return
		}
		if len(blocks) == 0 {
			return
		}
		back, _, err := (ConnDigests{Runs: encodeRuns(blocks, newest)}).index()
		if err != nil {
			t.Fatalf("re-encoded digests refused: %v", err)
		}
		for s, c := range blocks {
			if s%B != 0 || back[s] != c {
				t.Fatalf("block %d: %x after a round trip, want %x", s, back[s], c)
			}
		}
	})
}
