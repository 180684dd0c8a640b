package outputs

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestJournalBoundsSavedBytes: a job's user decides how much a restore cuts off its outputs, and the
// journal saves it in root's state directory first. Before, it copied all of it, however little room
// that left root (200 GiB written after the last snapshot: 200 GiB into root's file system); now a save
// that would take more than half of what is free there is refused, with nothing changed. Holes are not
// copied, so they do not count.
func TestJournalBoundsSavedBytes(t *testing.T) {
	const free = 1 << 20 // what statfs says the journal's file system has free
	tests := []struct {
		name     string
		kind     kind
		data, at int64 // the file holds data bytes from at; its size is at+data
		off      int64 // saved: [off, size)
		held     int64 // what the journal holds already, from earlier saves
		wantErr  string
	}{
		{name: "under the bound", kind: truncated, data: 256 << 10, off: 0},
		{name: "over the bound", kind: truncated, data: 768 << 10, off: 0, wantErr: "truncate the file to its snapshot size, 0 bytes"},
		{name: "over the bound, rewritten", kind: rewritten, data: 768 << 10, off: 0, wantErr: "remove the file yourself"},
		{name: "sparse: size over the bound, data under", kind: truncated, data: 64 << 10, at: 8 << 20, off: 4096},
		{name: "data over the bound, but not past off", kind: truncated, data: 2 << 20, off: 2<<20 - 256<<10},
		{name: "held by earlier saves counts", kind: truncated, data: 300 << 10, off: 0, held: 500 << 10, wantErr: "less the 512000 bytes it holds already"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "stdout")
			content := bytes.Repeat([]byte("x"), int(tc.data))
			f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o600)
			must(t, err)
			_, err = f.WriteAt(content, tc.at)
			must(t, err)
			must(t, f.Sync()) // its blocks allocated, as a job's output long written
			size := tc.at + tc.data

			jr, err := newJournal(filepath.Join(dir, "journal"), nil)
			must(t, err)
			defer jr.Close()
			jr.saved = tc.held
			jr.statfs = func(path string, st *unix.Statfs_t) error {
				if path != jr.dir {
					t.Errorf("statfs(%s), want the journal's directory %s", path, jr.dir)
				}
				*st = unix.Statfs_t{Bavail: free / 4096, Bsize: 4096}
				return nil
			}
			err = jr.save(tc.kind, p, f, tc.off, size)
			left, _ := os.ReadDir(jr.dir)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("save: %v", err)
				}
				b, err := os.ReadFile(filepath.Join(jr.dir, jr.entries[0].Saved))
				must(t, err)
				if int64(len(b)) != size-tc.off || !bytes.Equal(b[max(tc.at-tc.off, 0):], content[max(tc.off-tc.at, 0):]) {
					t.Errorf("saved %d bytes; want the file's [%d, %d)", len(b), tc.off, size)
				}
				return
			}
			f.Close()
			if err == nil {
				t.Fatalf("save of %d bytes of data with %d free: no error, journal holds %d files", tc.data, free, len(left))
			}
			t.Log(err)
			for _, want := range []string{p, "bytes free", strconv.Itoa(free), tc.wantErr, "or free space there, and retry"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
			if len(left) != 0 || len(jr.entries) != 0 || jr.saved != tc.held {
				t.Errorf("a refused save left %d files, %d entries, %d bytes counted in the journal", len(left), len(jr.entries), jr.saved)
			}
			if st, err := os.Stat(p); err != nil || st.Size() != size {
				t.Errorf("a refused save changed %s: %v, %v", p, st, err)
			}
		})
	}
}

// TestJournalSpaceSharedByRestores: restores running at once each journal their job's outputs in the same
// state directory. Each measured the free space alone, so two saves checked before either wrote took half
// of the same free space each: all of it. Now a save counts what the others sharing its Space are still
// writing.
func TestJournalSpaceSharedByRestores(t *testing.T) {
	const free = 1 << 20
	dir := t.TempDir()
	var space Space
	file := func(name string, n int) *os.File {
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, 0o600)
		must(t, err)
		t.Cleanup(func() { f.Close() })
		_, err = f.Write(bytes.Repeat([]byte("x"), n))
		must(t, err)
		must(t, f.Sync())
		return f
	}
	journal := func(name string) *Journal {
		jr, err := newJournal(filepath.Join(dir, name), &space)
		must(t, err)
		t.Cleanup(jr.Close)
		// The free space as the file system shows it before either save is written.
		jr.statfs = func(_ string, st *unix.Statfs_t) error {
			*st = unix.Statfs_t{Bavail: free / 4096, Bsize: 4096}
			return nil
		}
		return jr
	}
	a, b := journal("a"), journal("b")
	fa, fb := file("a.out", 400<<10), file("b.out", 400<<10)
	// a's save checked and not written yet: b's must count it.
	_, done, err := space.reserve(func(writing int64) (int64, error) {
		return a.fits(truncated, fa.Name(), fa, 0, 400<<10, writing)
	})
	must(t, err)
	errB := b.save(truncated, fb.Name(), fb, 0, 400<<10)
	done()
	if errB == nil {
		t.Fatalf("b saved 400 KiB while a was saving 400 KiB, of %d bytes free: together more than half of it", free)
	}
	if !strings.Contains(errB.Error(), "less the 409600 bytes other restores are saving there") {
		t.Errorf("error %q does not say what the other restores are saving", errB)
	}
	t.Log(errB)
	if err := b.save(truncated, fb.Name(), fb, 0, 400<<10); err != nil {
		t.Errorf("b's save once a's was written: %v", err)
	}
	if space.writing != 0 {
		t.Errorf("Space still counts %d bytes being written", space.writing)
	}
}
