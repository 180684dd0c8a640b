package ship

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/ftkit/ftkit/ckpt"
)

// memBase is a base held in memory, for the codec tests.
type memBase [][]byte

func (b memBase) Size(i uint32) (int64, bool) {
	if int(i) >= len(b) {
		return 0, false
	}
	return int64(len(b[i])), true
}

func (b memBase) ReadAt(i uint32, p []byte, off int64) error {
	_, err := bytes.NewReader(b[i]).ReadAt(p, off)
	return err
}

// memIndex indexes base files as indexBase does files on disk.
func memIndex(t testing.TB, base memBase, bs int) *baseIndex {
	t.Helper()
	dir := t.TempDir()
	m := &ckpt.Manifest{}
	for i, data := range base {
		name := "pages-" + string(rune('a'+i)) + ".img"
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
		m.Files = append(m.Files, ckpt.FileEntry{Name: name, Size: int64(len(data))})
	}
	idx, err := indexBase(context.Background(), dir, m, bs)
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

func rewritePages(data []byte, every int, seed byte) []byte {
	out := slices.Clone(data)
	for off := 0; off < len(out); off += every * 4096 {
		for i := off; i < min(off+4096, len(out)); i++ {
			out[i] ^= 0x5a + seed
		}
	}
	return out
}

// The block diff and its rebuild: every case rebuilds the new file exactly,
// and what is copied from the base (instead of sent) is what did not change.
func TestDeltaRoundTrip(t *testing.T) {
	base := memoryPages(4<<20, 7)
	moved := slices.Concat(make([]byte, 3*4096), base) // pages shifted by three
	cases := []struct {
		name       string
		base       memBase
		data       []byte
		bs         int
		minCopied  int64
		maxCopied  int64
		wantRefuse bool
	}{
		{name: "identical", base: memBase{base}, data: base, bs: 4096, minCopied: 4 << 20, maxCopied: 4 << 20},
		{name: "all changed", base: memBase{base}, data: memoryPages(4<<20, 8), bs: 4096, maxCopied: 3 << 20},
		{name: "10% rewritten", base: memBase{base}, data: rewritePages(base, 10, 1), bs: 4096, minCopied: 4 << 20 * 85 / 100, maxCopied: 4 << 20 * 91 / 100},
		{name: "10% rewritten, 64 KiB blocks", base: memBase{base}, data: rewritePages(base, 10, 1), bs: 64 << 10, maxCopied: 4 << 20 / 2},
		{name: "appended", base: memBase{base}, data: slices.Concat(base, memoryPages(1<<20+100, 9)), bs: 4096, minCopied: 4 << 20, maxCopied: 5 << 20},
		{name: "truncated", base: memBase{base}, data: base[:3<<20+17], bs: 4096, minCopied: 3 << 20, maxCopied: 3 << 20},
		{name: "moved by pages", base: memBase{base}, data: moved, bs: 4096, minCopied: 4 << 20, maxCopied: 4<<20 + 3*4096},
		{name: "blocks from a second base file", base: memBase{memoryPages(1<<20, 3), base}, data: base, bs: 4096, minCopied: 4 << 20, maxCopied: 4 << 20},
		{name: "empty file", base: memBase{base}, data: nil, bs: 4096},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			idx := memIndex(t, c.base, c.bs)
			var enc bytes.Buffer
			sent, err := encodeDelta("pages-a.img", bytes.NewReader(c.data), &enc, int64(len(c.data)), idx, nil, func() error { return nil })
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			copied, err := applyDelta(bytes.NewReader(enc.Bytes()), &out, int64(len(c.data)), c.bs, c.base)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out.Bytes(), c.data) {
				t.Fatal("rebuilt file differs from the new file")
			}
			if copied != sent || copied < c.minCopied || copied > c.maxCopied {
				t.Errorf("copied %d (encoder says %d), want %d..%d", copied, sent, c.minCopied, c.maxCopied)
			}
			if lit := int64(len(c.data)) - copied; int64(enc.Len()) > lit+lit/50+1024 {
				t.Errorf("diff is %d bytes for %d bytes not in the base", enc.Len(), lit)
			}
		})
	}
}

// A diff against a base the receiver does not hold, or holds in another
// version, is refused with errDeltaRefused (the sender then resends whole).
func TestDeltaRefusesWrongBase(t *testing.T) {
	base := memoryPages(2<<20, 7)
	idx := memIndex(t, memBase{base}, 4096)
	var enc bytes.Buffer
	if _, err := encodeDelta("pages-a.img", bytes.NewReader(base), &enc, int64(len(base)), idx, nil, func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	damaged := slices.Clone(base)
	damaged[5*4096+3] ^= 1
	for name, b := range map[string]memBase{
		"base missing":        {},
		"base block differs":  {damaged},
		"base file too short": {base[:1<<20]},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := applyDelta(bytes.NewReader(enc.Bytes()), io.Discard, int64(len(base)), 4096, b)
			if !errors.Is(err, errDeltaRefused) {
				t.Fatalf("applyDelta = %v, want errDeltaRefused", err)
			}
		})
	}
}

func deltaSeeds() [][]byte {
	copyOp := func(file uint32, block uint64, count uint32, check uint64) []byte {
		b := []byte{opCopy}
		b = append(b, byte(file>>24), byte(file>>16), byte(file>>8), byte(file))
		for i := 7; i >= 0; i-- {
			b = append(b, byte(block>>(8*i)))
		}
		b = append(b, byte(count>>24), byte(count>>16), byte(count>>8), byte(count))
		for i := 7; i >= 0; i-- {
			b = append(b, byte(check>>(8*i)))
		}
		return b
	}
	lit := func(count uint32, data []byte) []byte {
		return slices.Concat([]byte{opLit, byte(count >> 24), byte(count >> 16), byte(count >> 8), byte(count)}, data)
	}
	return [][]byte{
		lit(2, bytes.Repeat([]byte{1}, 8192)),
		slices.Concat(copyOp(0, 0, 1, 0), lit(1, make([]byte, 4096))),
		copyOp(0, 1<<62, 0xffffffff, 0),
		lit(0xffffffff, nil),
		{9},
		slices.Concat(lit(2, make([]byte, 8192)), []byte{0}),
	}
}

// FuzzApplyDelta feeds untrusted operations to the decoder: it never writes
// more than the file size, never reads outside the base, and anything it
// accepts is exactly size bytes.
func FuzzApplyDelta(f *testing.F) {
	for _, s := range deltaSeeds() {
		f.Add(s)
	}
	base := memBase{bytes.Repeat([]byte{7}, 3*4096), make([]byte, 4096)}
	f.Fuzz(func(t *testing.T, data []byte) {
		const size = 2*4096 + 100
		var out bytes.Buffer
		lw := &limitedWriter{w: &out, h: nopHash{}, left: size}
		_, err := applyDelta(bytes.NewReader(data), lw, size, 4096, base)
		if lw.over {
			t.Fatal("decoder wrote past the file size")
		}
		if err == nil && out.Len() != size {
			t.Fatalf("accepted a diff of %d bytes for a %d-byte file", out.Len(), size)
		}
		if err != nil && !errors.Is(err, ErrProtocol) && !errors.Is(err, errDeltaRefused) && !errors.Is(err, errTooLong) {
			t.Fatalf("unexpected error kind: %v", err)
		}
	})
}

type nopHash struct{}

func (nopHash) Write(p []byte) (int, error) { return len(p), nil }
func (nopHash) Sum(b []byte) []byte         { return b }
func (nopHash) Reset()                      {}
func (nopHash) Size() int                   { return 0 }
func (nopHash) BlockSize() int              { return 1 }

// shipPipe sends snapshot id from origin to prot over a pipe.
func shipPipe(t testing.TB, origin, prot *ckpt.Store, id string, sopts SendOptions) (*Sent, *Received) {
	t.Helper()
	return shipPipeTo(t, origin, prot, id, sopts, ReceiveOptions{})
}

// shipPipeTo is shipPipe with the receiver's options (its Peer and Authorize are set here).
func shipPipeTo(t testing.TB, origin, prot *ckpt.Store, id string, sopts SendOptions, ropts ReceiveOptions) (*Sent, *Received) {
	t.Helper()
	ropts.Peer, ropts.Authorize = "node1", FromNode("node1")
	c1, c2 := net.Pipe()
	defer c1.Close()
	type result struct {
		r   *Received
		err error
	}
	got := make(chan result, 1)
	go func() {
		defer c2.Close()
		r, err := Receive(context.Background(), c2, prot, ropts)
		got <- result{r, err}
	}()
	sopts.Peer = "prot"
	sent, err := Send(context.Background(), c1, origin, "job", id, sopts)
	res := <-got
	if err != nil {
		t.Fatalf("send: %v (receiver: %v)", err, res.err)
	}
	if res.err != nil {
		t.Fatal(res.err)
	}
	return sent, res.r
}

// deltaFiles is a snapshot with two large pages files (one of which will
// shrink) and small images.
func deltaFiles(pages1, pages2 []byte) map[string][]byte {
	return map[string][]byte{
		"pages-1.img":       pages1,
		"pages-2.img":       pages2,
		"pagemap-1.img":     []byte("pagemap entries"),
		"tcp-stream-77.img": bytes.Repeat([]byte("q"), 5000),
	}
}

// A second snapshot that rewrote 10% of its pages goes as a diff against
// the first, which the protector offered: it costs at most 15% of a whole
// send on the wire, and the protector's copy verifies and is byte for byte
// the sender's, as a whole send would be.
func TestSendDelta(t *testing.T) {
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	full := openStore(t, "prot2")
	p1, p2 := memoryPages(8<<20, 1), memoryPages(3<<20, 2)
	m1 := makeSnapshot(t, origin, "job", deltaFiles(p1, p2))
	if s, _ := shipPipe(t, origin, prot, m1.ID, SendOptions{}); s.BaseID != "" {
		t.Fatalf("first snapshot sent as a diff against %s", s.BaseID)
	}
	m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(p1, 10, 3), rewritePages(p2[:2<<20], 10, 4)))
	sent, got := shipPipe(t, origin, prot, m2.ID, SendOptions{})
	if sent.BaseID != m1.ID || got.BaseID != m1.ID || sent.DeltaRefused {
		t.Fatalf("sent against %q (receiver says %q, refused %v), want %s", sent.BaseID, got.BaseID, sent.DeltaRefused, m1.ID)
	}
	if sent.CopiedBytes != got.CopiedBytes || got.CopiedBytes < (10<<20)*8/10 {
		t.Errorf("copied %d (sender) %d (receiver) of %d", sent.CopiedBytes, got.CopiedBytes, m2.TotalSize())
	}
	// The same snapshot whole, to a protector without a base.
	whole, _ := shipPipe(t, origin, full, m2.ID, SendOptions{})
	if whole.BaseID != "" {
		t.Fatalf("sent against %s to a protector without a base", whole.BaseID)
	}
	ratio := float64(sent.WireBytes) / float64(whole.WireBytes)
	t.Logf("diff %d wire bytes, whole %d (%.3f); snapshot %d bytes", sent.WireBytes, whole.WireBytes, ratio, m2.TotalSize())
	if ratio > 0.15 {
		t.Errorf("diff costs %.3f of a whole send on the wire, want <= 0.15", ratio)
	}
	if _, err := prot.Verify(context.Background(), "job", m2.ID); err != nil {
		t.Fatal(err)
	}
	for _, f := range m2.Files {
		a, _ := os.ReadFile(filepath.Join(origin.Path("job", m2.ID), f.Name))
		b, _ := os.ReadFile(filepath.Join(prot.Path("job", m2.ID), f.Name))
		c, _ := os.ReadFile(filepath.Join(full.Path("job", m2.ID), f.Name))
		if !bytes.Equal(a, b) || !bytes.Equal(b, c) {
			t.Errorf("%s differs between the origin, the diffed copy and the whole copy", f.Name)
		}
	}
	assertPrivate(t, prot)
}

// A base indexed ahead (IndexBase, SendOptions.Base) is used as it is: the sender does not read the
// base again, so the diff goes even after the sender's copy of the base lost its pages file (without the
// index ahead, indexing fails and the snapshot goes whole). An index of another snapshot than the one the
// protector offers, or with another block size, is not used.
func TestSendWithBaseIndexedAhead(t *testing.T) {
	for _, c := range []struct {
		name     string
		ahead    func(m0, m1 *ckpt.Manifest) (string, int)
		block    int
		kept     bool
		wantDiff bool
	}{
		{name: "indexed ahead", ahead: func(_, m1 *ckpt.Manifest) (string, int) { return m1.ID, 0 }, wantDiff: true},
		{name: "none", wantDiff: false},
		{name: "another snapshot", ahead: func(m0, _ *ckpt.Manifest) (string, int) { return m0.ID, 0 }, wantDiff: false},
		{name: "another block size", ahead: func(_, m1 *ckpt.Manifest) (string, int) { return m1.ID, 64 << 10 }, wantDiff: false},
		// m1's own transfer (a diff against m0) kept its index (KeepIndex, Sent.Index), as the agent does.
		{name: "kept from its transfer", kept: true, wantDiff: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			origin := openStore(t, "node1")
			prot := openStore(t, "prot")
			p1, p2 := memoryPages(4<<20, 1), memoryPages(2<<20, 2)
			m0 := makeSnapshot(t, origin, "job", deltaFiles(memoryPages(4<<20, 9), p2)) // older, not offered first
			shipPipe(t, origin, prot, m0.ID, SendOptions{})
			m1 := makeSnapshot(t, origin, "job", deltaFiles(p1, p2))
			sent1, _ := shipPipe(t, origin, prot, m1.ID, SendOptions{KeepIndex: c.kept})
			var opts SendOptions
			if c.kept {
				if sent1.Index == nil || sent1.Index.ID() != m1.ID {
					t.Fatalf("the transfer of %s kept the index %+v", m1.ID, sent1.Index)
				}
				opts.Base = sent1.Index
			}
			if c.ahead != nil {
				id, bs := c.ahead(m0, m1)
				b, err := IndexBase(context.Background(), origin, "job", id, bs)
				if err != nil {
					t.Fatal(err)
				}
				if b.ID() != id {
					t.Fatalf("index of %s says %s", id, b.ID())
				}
				opts.Base = b
			}
			if err := os.Remove(filepath.Join(origin.Path("job", m1.ID), "pages-1.img")); err != nil {
				t.Fatal(err)
			}
			m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(p1, 10, 3), p2))
			sent, got := shipPipe(t, origin, prot, m2.ID, opts)
			if diff := sent.BaseID == m1.ID; diff != c.wantDiff || got.BaseID != sent.BaseID {
				t.Errorf("sent against %q (receiver %q), want a diff against %s: %v", sent.BaseID, got.BaseID, m1.ID, c.wantDiff)
			}
			if _, err := prot.Verify(context.Background(), "job", m2.ID); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The index a transfer keeps (KeepIndex) is the one IndexBase would read from the snapshot afterwards,
// whether its large files went whole or as a diff, whatever their sizes; without KeepIndex there is none.
func TestSentIndexIsIndexBase(t *testing.T) {
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	p1, p2 := memoryPages(5<<20+1234, 1), memoryPages(2<<20, 2) // one file's last block is short
	m1 := makeSnapshot(t, origin, "job", deltaFiles(p1, p2))
	m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(p1, 10, 3), p2[:1<<20+4095]))
	for _, c := range []struct {
		m        *ckpt.Manifest
		opts     SendOptions
		wantBase string
	}{
		{m1, SendOptions{KeepIndex: true}, ""},
		{m2, SendOptions{KeepIndex: true, JustCommitted: true}, m1.ID},
	} {
		sent, _ := shipPipe(t, origin, prot, c.m.ID, c.opts)
		if sent.BaseID != c.wantBase {
			t.Fatalf("%s sent against %q, want %q", c.m.ID, sent.BaseID, c.wantBase)
		}
		want, err := IndexBase(context.Background(), origin, "job", c.m.ID, 0)
		if err != nil {
			t.Fatal(err)
		}
		if sent.Index == nil || sent.Index.idx.where != nil {
			t.Fatalf("%s: kept index %+v, want one of hashes only", c.m.ID, sent.Index)
		}
		if got := sent.Index.idx.locate(); !reflect.DeepEqual(got, want.idx) || sent.Index.want != want.want {
			t.Errorf("%s: kept index (block %d, %d files) differs from IndexBase's (block %d, %d files)",
				c.m.ID, got.bs, len(got.hashes), want.idx.bs, len(want.idx.hashes))
		}
		if n := len(want.idx.hashes); n != 2 {
			t.Errorf("%s: IndexBase indexed %d files, want the 2 pages files", c.m.ID, n)
		}
	}
	if sent, _ := shipPipe(t, origin, openStore(t, "prot2"), m2.ID, SendOptions{}); sent.Index != nil {
		t.Error("an index kept without KeepIndex")
	}
}

// blockHashes hashes the same blocks however the bytes are cut into writes; a short last block is not
// hashed.
func TestBlockHashes(t *testing.T) {
	data := memoryPages(64<<10+100, 7)
	var want []uint64
	for off := 0; off+4096 <= len(data); off += 4096 {
		want = append(want, xxhash.Sum64(data[off:off+4096]))
	}
	for _, cut := range []int{1, 100, 4095, 4096, 4097, 10000, len(data)} {
		bh := newBlockHashes(4096, int64(len(data)))
		for p := data; len(p) > 0; {
			k := min(cut, len(p))
			if n, err := bh.Write(p[:k]); n != k || err != nil {
				t.Fatalf("Write: %d, %v", n, err)
			}
			p = p[k:]
		}
		if !slices.Equal(bh.hs, want) {
			t.Errorf("writes of %d bytes: %d hashes, want %d equal to the blocks'", cut, len(bh.hs), len(want))
		}
	}
}

// When the protector's base is damaged (a block of it differs) or it lists
// other files than the sender's copy, the diff is refused, the sender resends
// whole on the same connection, and the protector's copy verifies. With
// NoDelta, or when the protector holds no base, the first attempt is whole.
func TestSendDeltaFallsBack(t *testing.T) {
	cases := []struct {
		name       string
		damage     func(t *testing.T, prot *ckpt.Store, base *ckpt.Manifest)
		opts       SendOptions
		wantBase   bool
		wantRefuse bool
	}{
		{name: "base block differs", wantBase: true, wantRefuse: true, damage: func(t *testing.T, prot *ckpt.Store, base *ckpt.Manifest) {
			path := filepath.Join(prot.Path("job", base.ID), "pages-1.img")
			f, err := os.OpenFile(path, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt([]byte("bit rot"), 4096*5+10); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "base file missing", wantBase: true, wantRefuse: true, damage: func(t *testing.T, prot *ckpt.Store, base *ckpt.Manifest) {
			if err := os.Remove(filepath.Join(prot.Path("job", base.ID), "pages-2.img")); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "base deleted", damage: func(t *testing.T, prot *ckpt.Store, base *ckpt.Manifest) {
			if err := prot.Delete("job", base.ID); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "NoDelta", opts: SendOptions{NoDelta: true}},
		{name: "64 KiB blocks", opts: SendOptions{DeltaBlock: 64 << 10}, wantBase: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			origin := openStore(t, "node1")
			prot := openStore(t, "prot")
			p1, p2 := memoryPages(4<<20, 1), memoryPages(2<<20, 2)
			m1 := makeSnapshot(t, origin, "job", deltaFiles(p1, p2))
			shipPipe(t, origin, prot, m1.ID, SendOptions{})
			if c.damage != nil {
				c.damage(t, prot, m1)
			}
			m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(p1, 10, 3), p2))
			sent, got := shipPipe(t, origin, prot, m2.ID, c.opts)
			if (sent.BaseID != "") != (c.wantBase && !c.wantRefuse) || sent.DeltaRefused != c.wantRefuse || got.DeltaRefused != c.wantRefuse {
				t.Errorf("base %q, refused %v (receiver %v); want diff %v, refused %v", sent.BaseID, sent.DeltaRefused, got.DeltaRefused, c.wantBase, c.wantRefuse)
			}
			if c.wantRefuse && (sent.CopiedBytes != 0 || got.CopiedBytes != 0) {
				t.Errorf("a refused diff reports %d/%d bytes copied", sent.CopiedBytes, got.CopiedBytes)
			}
			if _, err := prot.Verify(context.Background(), "job", m2.ID); err != nil {
				t.Fatal(err)
			}
			noLeftovers(t, prot, "job")
			// The next snapshot ships too (against m2, or whole).
			m3 := makeSnapshot(t, origin, "job", deltaFiles(p1, p2))
			shipPipe(t, origin, prot, m3.ID, c.opts)
			if _, err := prot.Verify(context.Background(), "job", m3.ID); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// BenchmarkDeltaBlock compares block sizes on 64 MiB of memory-like pages
// of which 10% were rewritten, scattered page by page or in 64 KiB runs:
// it reports the share of the file that must go on the wire and the
// sender's encoding throughput (the base index is built once, outside).
func BenchmarkDeltaBlock(b *testing.B) {
	base := memoryPages(64<<20, 7)
	for _, pattern := range []struct {
		name string
		data []byte
	}{
		{"scattered", rewritePages(base, 10, 1)},
		{"runs", rewriteRuns(base, 16, 10)},
	} {
		for _, bs := range []int{4096, 16 << 10, 64 << 10} {
			b.Run(fmt.Sprintf("%s/%dK", pattern.name, bs>>10), func(b *testing.B) {
				idx := memIndex(b, memBase{base}, bs)
				b.SetBytes(int64(len(pattern.data)))
				var enc int
				for b.Loop() {
					var w countWriter
					if _, err := encodeDelta("pages-a.img", bytes.NewReader(pattern.data), &w, int64(len(pattern.data)), idx, nil, func() error { return nil }); err != nil {
						b.Fatal(err)
					}
					enc = int(w.n)
				}
				b.ReportMetric(float64(enc)/float64(len(pattern.data)), "diff/size")
			})
		}
	}
}

// rewriteRuns rewrites runs of run pages, one run in every `every`.
func rewriteRuns(data []byte, run, every int) []byte {
	out := slices.Clone(data)
	for off := 0; off < len(out); off += run * every * 4096 {
		for i := off; i < min(off+run*4096, len(out)); i++ {
			out[i] ^= 0x5a
		}
	}
	return out
}

// The sender diffs only against its snapshot's own lineage, as the receiver offers: a peer's snapshot
// of the same job held here as a replica is never the base, whatever a protector offers, since the COPY
// operations' positions and checks would tell that protector about the peer's memory.
func TestPickBaseOnlyFromOwnLineage(t *testing.T) {
	peer := openStore(t, "node1")
	sender := openStore(t, "node2")
	p1, p2 := memoryPages(2<<20, 1), memoryPages(2<<20, 2)
	replica := makeSnapshot(t, peer, "job", deltaFiles(p1, p2))
	shipPipe(t, peer, sender, replica.ID, SendOptions{}) // node2 protects node1
	own := makeSnapshot(t, sender, "job", deltaFiles(memoryPages(2<<20, 3), p2))
	m := makeSnapshot(t, sender, "job", deltaFiles(rewritePages(p1, 10, 3), p2))
	for _, c := range []struct {
		name   string
		offers []string
		want   string // "" sends whole
	}{
		{name: "peer's replica only", offers: []string{replica.ID}, want: ""},
		{name: "peer's replica first", offers: []string{replica.ID, own.ID}, want: own.ID},
		{name: "own", offers: []string{own.ID}, want: own.ID},
	} {
		t.Run(c.name, func(t *testing.T) {
			idx := pickBase(context.Background(), sender, "job", m.ID, c.offers, 0, nil, slog.New(slog.DiscardHandler))
			got := ""
			if idx != nil {
				got = idx.id
			}
			if got != c.want {
				t.Errorf("picked base %q among %v, want %q", got, c.offers, c.want)
			}
		})
	}
}
