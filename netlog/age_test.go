package netlog

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// textStream is a compressible stream (lz4 shrinks it about 3x).
func textStream(n int) []byte {
	words := strings.Fields("the quick brown fox jumps over a lazy dog while MPI ranks exchange halo rows of doubles")
	r := testStream(11, n)
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		b.WriteString(words[int(r[i%len(r)])%len(words)])
		b.WriteByte(' ')
	}
	return b.Bytes()[:n]
}

func appendAll(t testing.TB, s *Store, isn uint32, stream []byte, seg int) {
	t.Helper()
	for off := 0; off < len(stream); off += seg {
		if err := s.Append(isn+uint32(off), stream[off:min(off+seg, len(stream))]); err != nil {
			t.Fatal(err)
		}
	}
}

func mustBytes(t testing.TB, s *Store, from, to uint64) []byte {
	t.Helper()
	b, err := s.Bytes(from, to)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAgeCompresses(t *testing.T) {
	const slab = 4096
	s := newTestStore(t, Options{SlabSize: slab, CompressAfter: time.Minute})
	stream := textStream(64*slab + 100)
	isn := uint32(1<<32 - 5*slab) // slab-aligned, and the stream crosses the wrap
	base := AnchorEpoch | uint64(isn)
	appendAll(t, s, isn, stream, 1448)

	// Nothing is old enough yet.
	r, err := s.Age(context.Background(), time.Now())
	if err != nil || r.Compressed != 0 {
		t.Fatalf("early age: %+v %v", r, err)
	}
	r, err = s.Age(context.Background(), time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	// isn is slab-aligned here, so 64 full slabs are sealed; the 100-byte tail is not.
	if r.Compressed != 64 || st.CompressedSlabs != 64 || st.RAMSlabs != 1 || st.CompressedRawBytes != 64*slab {
		t.Fatalf("report %+v stats %+v", r, st)
	}
	if st.CompressedBytes*2 > st.CompressedRawBytes || st.CompressedBytes != r.CompressedTo {
		t.Fatalf("lz4 kept %d of %d bytes", st.CompressedBytes, st.CompressedRawBytes)
	}
	// Reads reassemble across compressed and raw slabs, at any alignment.
	for _, rg := range [][2]int{{0, len(stream)}, {slab - 7, 3*slab + 9}, {63*slab + 50, len(stream)}, {5, 6}} {
		if got := mustBytes(t, s, base+uint64(rg[0]), base+uint64(rg[1])); !bytes.Equal(got, stream[rg[0]:rg[1]]) {
			t.Fatalf("range %v differs after compression", rg)
		}
	}
	var w bytes.Buffer
	if _, err := s.WriteRange(context.Background(), &w, base, base+uint64(len(stream))); err != nil || !bytes.Equal(w.Bytes(), stream) {
		t.Fatalf("WriteRange after compression: %v", err)
	}
	// A retransmission into compressed slabs is verified against them, and a corrupt one
	// is caught.
	if err := s.Append(isn+3*slab-10, stream[3*slab-10:3*slab+2000]); err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(stream[2*slab : 3*slab])
	bad[100] ^= 1
	var ce *ConflictError
	if err := s.Append(isn+2*slab, bad); !errors.As(err, &ce) || ce.From != base+2*slab+100 {
		t.Fatalf("corrupt retransmission into a compressed slab: %v", err)
	}
	// Trim frees compressed slabs too.
	if _, err := s.Trim(isn + 60*slab); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.CompressedSlabs != 4 || st.CompressedRawBytes != 4*slab {
		t.Fatalf("after trim: %+v", st)
	}
}

func TestAgeIncompressibleAndPressure(t *testing.T) {
	const slab = 4096
	s := newTestStore(t, Options{SlabSize: slab, CompressAboveRAM: 8 * slab})
	random := testStream(5, 16*slab)
	appendAll(t, s, 0, random, 65536)
	r, err := s.Age(context.Background(), time.Now())
	if err != nil || r.Compressed != 0 || r.Incompressible != 8 {
		t.Fatalf("random data under pressure: %+v %v", r, err)
	}
	// Still under pressure: the other 8 are tried, then nothing is retried.
	if r, _ := s.Age(context.Background(), time.Now()); r.Incompressible != 8 {
		t.Fatalf("second pass: %+v", r)
	}
	if r, _ := s.Age(context.Background(), time.Now()); r.Incompressible != 0 || s.Stats().RAMSlabs != 16 {
		t.Fatalf("incompressible slabs retried: %+v", r)
	}
	// Pressure compresses young compressible slabs, oldest first, until under the mark.
	s2 := newTestStore(t, Options{SlabSize: slab, CompressAboveRAM: 8 * slab})
	appendAll(t, s2, 0, textStream(16*slab), 65536)
	r, err = s2.Age(context.Background(), time.Now())
	if err != nil || r.Compressed != 8 {
		t.Fatalf("text under pressure: %+v %v", r, err)
	}
	if st := s2.Stats(); st.RAMBytes > 8*slab+st.PooledBytes {
		t.Fatalf("RAM %d still above the mark: %+v", st.RAMBytes, st)
	}
}

func TestSpill(t *testing.T) {
	const slab = 4096
	dir := t.TempDir() // a real disk: fsync must work there
	s := newTestStore(t, Options{SlabSize: slab, CompressAfter: time.Nanosecond, SpillDir: dir, SpillAboveRAM: 4 * slab})
	stream := textStream(40*slab + 10)
	isn := uint32(12345 * slab)
	base := AnchorEpoch | uint64(isn)
	appendAll(t, s, isn, stream[:20*slab], 1448)
	// The first pass compresses; memory is still above 4 slabs, so it spills too.
	r, err := s.Age(context.Background(), time.Now().Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if r.Spilled == 0 || st.SpilledSlabs != int64(r.Spilled) || st.MemoryBytes() > 4*slab {
		t.Fatalf("report %+v stats %+v", r, st)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("spill file left a name in %s: %v", dir, entries)
	}
	// Raw slabs spill too (compression disabled by incompressible data).
	appendAll(t, s, isn+20*slab, stream[20*slab:], 1448)
	if _, err := s.Age(context.Background(), time.Now().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := mustBytes(t, s, base, base+uint64(len(stream))); !bytes.Equal(got, stream) {
		t.Fatal("bytes differ after spilling")
	}
	if err := s.Append(isn+slab, stream[slab:5*slab]); err != nil { // retransmission over spilled slabs
		t.Fatalf("duplicate over spilled slabs: %v", err)
	}
	f := s.env.spill
	fi, err := f.f.Stat()
	if err != nil || fi.Size() == 0 {
		t.Fatalf("spill file size %v %v", fi, err)
	}

	// Corrupt one spilled slab on disk: the read fails loudly, never returns other bytes.
	s.mu.RLock()
	ref := *s.slabAt(base>>12 + 2).spill
	s.mu.RUnlock()
	orig := make([]byte, 1)
	if _, err := f.f.ReadAt(orig, ref.off+int64(ref.n)/2); err != nil {
		t.Fatal(err)
	}
	if _, err := f.f.WriteAt([]byte{orig[0] ^ 0xFF}, ref.off+int64(ref.n)/2); err != nil {
		t.Fatal(err)
	}
	_, err = s.Bytes(base+2*slab, base+2*slab+10)
	if err == nil || errors.Is(err, ErrHole) || errors.Is(err, ErrTrimmed) {
		t.Fatalf("corrupted spill read: %v, want a checksum or decode error", err)
	}
	t.Logf("corrupted spill read fails with: %v", err)
	f.f.WriteAt(orig, ref.off+int64(ref.n)/2)

	// Trim releases spill space; trimming everything empties the file.
	before := s.Stats().SpilledBytes
	if _, err := s.Trim(isn + 10*slab); err != nil {
		t.Fatal(err)
	}
	if after := s.Stats().SpilledBytes; after >= before {
		t.Fatalf("trim kept spilled bytes: %d -> %d", before, after)
	}
	if _, err := s.Trim(isn + uint32(len(stream))); err != nil {
		t.Fatal(err)
	}
	st = s.Stats()
	fi, _ = f.f.Stat()
	if st.SpilledBytes != 0 || st.SpilledSlabs != 0 || st.RetainedBytes != 0 || fi.Size() != 0 {
		t.Fatalf("after trimming everything: %+v, file %d bytes", st, fi.Size())
	}
}

func TestSpillRequiresWritableDir(t *testing.T) {
	s := newTestStore(t, Options{SlabSize: 256, SpillDir: "/nonexistent/netlog", SpillAboveRAM: 1})
	appendAll(t, s, 0, textStream(4096), 256)
	if _, err := s.Age(context.Background(), time.Now()); err == nil {
		t.Fatal("spilling into a missing directory succeeded")
	}
	// Nothing was lost.
	if got := mustBytes(t, s, AnchorEpoch, AnchorEpoch+4096); !bytes.Equal(got, textStream(4096)) {
		t.Fatal("bytes lost after a failed spill")
	}
}

// TestAgeCancelled checks that a cancelled pass leaves every slab usable and agable again.
func TestAgeCancelled(t *testing.T) {
	const slab = 4096
	s := newTestStore(t, Options{SlabSize: slab, CompressAfter: time.Nanosecond, SpillDir: t.TempDir(), SpillAboveRAM: slab})
	stream := textStream(16 * slab)
	appendAll(t, s, 0, stream, 4096)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Age(ctx, time.Now().Add(time.Second)); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled age: %v", err)
	}
	if st := s.Stats(); st.CompressedSlabs != 0 || st.SpilledSlabs != 0 {
		t.Fatalf("cancelled pass changed slabs: %+v", st)
	}
	s.compress(context.Background(), time.Now().Add(time.Second), &ager{})
	if _, err := s.spillSlabs(ctx, 1<<30); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled spill: %v", err)
	}
	r, err := s.Age(context.Background(), time.Now().Add(time.Second))
	if err != nil || r.Spilled == 0 {
		t.Fatalf("age after cancellations: %+v %v", r, err)
	}
	if got := mustBytes(t, s, AnchorEpoch, AnchorEpoch+uint64(len(stream))); !bytes.Equal(got, stream) {
		t.Fatal("bytes differ after cancelled passes")
	}
}

// Spilled bytes are other programs' traffic: the spill file is 0600 whatever the umask, and has no name.
func TestSpillFileIsPrivate(t *testing.T) {
	old := unix.Umask(0)
	defer unix.Umask(old)
	const slab = 4096
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o700); err != nil { // made 0777 under umask 0: no spill directory
		t.Fatal(err)
	}
	s := newTestStore(t, Options{SlabSize: slab, CompressAfter: time.Nanosecond, SpillDir: dir, SpillAboveRAM: slab})
	appendAll(t, s, 0, textStream(8*slab), 1448)
	r, err := s.Age(context.Background(), time.Now().Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if r.Spilled == 0 || s.env.spill == nil {
		t.Fatalf("nothing spilled: %+v", r)
	}
	fi, err := s.env.spill.f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("spill file mode %v, want 0600", fi.Mode().Perm())
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("spill file has a name in %s: %v", dir, entries)
	}
}

// TestSpillDirMustBePrivate: logged bytes go only into a spill directory that is a real directory of this
// user's that no one else may write to, opened as it is (as ftagent --check-config wants log.spill_dir):
// not one whose entries others could rename or replace, and not a link another user could have put there
// (or point elsewhere: a file system of theirs). Before, the spill file was created wherever the path led.
// Nothing is lost on refusal.
func TestSpillDirMustBePrivate(t *testing.T) {
	const slab = 4096
	private := t.TempDir()
	for _, tc := range []struct {
		name string
		dir  func(t *testing.T) string
		ok   bool
	}{
		{"private", func(t *testing.T) string { return t.TempDir() }, true},
		{"world-writable", func(t *testing.T) string {
			d := t.TempDir()
			if err := os.Chmod(d, 0o777); err != nil {
				t.Fatal(err)
			}
			return d
		}, false},
		{"writable by its group", func(t *testing.T) string {
			d := t.TempDir()
			if err := os.Chmod(d, 0o770); err != nil {
				t.Fatal(err)
			}
			return d
		}, false},
		{"a link", func(t *testing.T) string {
			l := t.TempDir() + "/spill"
			if err := os.Symlink(private, l); err != nil {
				t.Fatal(err)
			}
			return l
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestStore(t, Options{SlabSize: slab, SpillDir: tc.dir(t), SpillAboveRAM: slab})
			stream := textStream(8 * slab)
			appendAll(t, s, 0, stream, 1448)
			r, err := s.Age(context.Background(), time.Now())
			if tc.ok != (err == nil && r.Spilled > 0) {
				t.Errorf("spilled %d slabs, err %v; want spilled %v", r.Spilled, err, tc.ok)
			}
			if got := mustBytes(t, s, AnchorEpoch, AnchorEpoch+uint64(len(stream))); !bytes.Equal(got, stream) {
				t.Error("bytes differ after the spill")
			}
		})
	}
}

// TestAppendOverUnreadableSpill: a segment that overlaps a spilled slab the store cannot read back (a
// corrupted or failing spill disk) cannot be compared there. Before, the read error rejected the whole
// segment: its bytes past the log's end were lost (a hole), and a conflict in a readable part of it (a new
// connection on the same 4-tuple) went unnoticed, so ranges from below it were served the old bytes.
func TestAppendOverUnreadableSpill(t *testing.T) {
	const slab = 4096
	tests := []struct {
		name     string
		from, to int // the segment, stream offsets
		flip     int // a byte of the segment changed (a stream offset), -1 for none
		conflict bool
	}{
		{name: "retransmission running into new bytes", from: 7*slab + 10, to: 8*slab + 600, flip: -1},
		{name: "conflict in a readable slab after the unreadable one", from: 7*slab + 10, to: 8*slab + 50, flip: 8*slab + 20, conflict: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestStore(t, Options{SlabSize: slab, SpillDir: t.TempDir(), SpillAboveRAM: 1, Logger: slog.New(slog.DiscardHandler)})
			stream := textStream(10 * slab)
			isn := uint32(12345 * slab)
			base := AnchorEpoch | uint64(isn)
			appendAll(t, s, isn, stream[:8*slab+100], 1448)
			if _, err := s.Age(context.Background(), time.Now()); err != nil {
				t.Fatal(err)
			}
			// Corrupt spilled slab 7 on disk.
			s.mu.RLock()
			sl := s.slabAt(base>>12 + 7)
			if sl == nil || sl.spill == nil {
				s.mu.RUnlock()
				t.Fatalf("slab 7 not spilled: %+v", s.Stats())
			}
			ref := *sl.spill
			s.mu.RUnlock()
			if _, err := s.env.spill.f.WriteAt([]byte{0xFF, 0x00, 0xFF}, ref.off+int64(ref.n)/2); err != nil {
				t.Fatal(err)
			}

			p := bytes.Clone(stream[tc.from:tc.to])
			if tc.flip >= 0 {
				p[tc.flip-tc.from] ^= 0xA5
			}
			err := s.Append(isn+uint32(tc.from), p)
			b := s.Bounds()
			if tc.conflict {
				if !errors.Is(err, ErrConflict) || b.ConflictEnd == 0 {
					t.Fatalf("append with a changed byte at %d: %v, conflict end %d: want a conflict", tc.flip, err, b.ConflictEnd)
				}
				return
			}
			if err == nil || errors.Is(err, ErrConflict) {
				t.Fatalf("append over the unreadable slab: %v, want the read error", err)
			}
			got, rerr := s.Bytes(base+8*slab+100, base+uint64(tc.to))
			if rerr != nil || !bytes.Equal(got, stream[8*slab+100:tc.to]) {
				t.Fatalf("append over the unreadable slab (%v) lost the segment's new bytes: %v", err, rerr)
			}
			if _, rerr := s.Bytes(base+7*slab, base+7*slab+10); rerr == nil {
				t.Fatal("the unreadable slab was read")
			}
		})
	}
}
